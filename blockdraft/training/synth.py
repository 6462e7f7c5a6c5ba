"""Synthesized training prompts: the target writes the user turns itself.

Method (Magpie, Xu et al. 2024, arXiv:2406.08464, section 2.1): an aligned chat model given only
its chat template up to where a user message's content begins ("pre-query template") continues
with a plausible user request, ending the turn with its end-of-turn token. Sampling that at T = 1
yields many diverse requests in the target's own domain (code, for a coder model), an unlimited
prompt source beside the ShareGPT prompts. The requests then go through the same filters as
ShareGPT prompts (`prompts.select_prompts`: length, ASCII share, duplicates, and no overlap with
HumanEval / MT-bench) and the target answers them like any other prompt.
"""

from __future__ import annotations

from blockdraft.training.generate import generate_with_engine
from blockdraft.training.prompts import select_prompts

_MARKER = "\u2063BLOCKDRAFT_USER_CONTENT\u2063"


def pre_query_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the first user message's content begins (the
    template's default system turn included, as a plain chat request would have it).

    Raises:
        ValueError: the template does not render a user message's content verbatim.
    """
    chat = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARKER not in chat:
        raise ValueError("the chat template does not render the user message's content verbatim; "
                         "cannot build a pre-query template for prompt synthesis")
    return tokenizer.encode(chat[: chat.index(_MARKER)], add_special_tokens=False)


def synthesize_prompts(
    llm, num_samples: int, eval_texts: list[str], seed: int = 0, temperature: float = 1.0,
    max_tokens: int = 256, deadline: float | None = None, progress: bool = False,
) -> tuple[list[str], dict]:
    """User requests written by `llm`'s target from its pre-query template, filtered.

    Args:
        llm: blockdraft.llm.LLM on the target (its tokenizer and engine are used).
        num_samples: requests to sample (seed `seed + i` for sample i).
        eval_texts: evaluation prompts a training prompt must not overlap (corpora.all_eval_texts).
        max_tokens: samples that reach this length without ending their turn are dropped.
        deadline: wall-clock time (time.time() seconds) after which sampling stops (generate_with_engine).
    Returns:
        (texts, stats): the kept requests (deduplicated, eval-free, shuffled with `seed`) and counts:
        sampled; unfinished (no end of turn) = out_of_time (not done by the deadline) + too_long
        (reached max_tokens); then the select_prompts filters.
    """
    tok = llm.tokenizer
    eos = set(llm.engine.eos_token_ids)
    pre = pre_query_ids(tok)
    outs = generate_with_engine(llm, [pre] * num_samples, max_tokens, [True] * num_samples, temperature, seed,
                                progress=progress, deadline=deadline)
    texts = [tok.decode(o[:-1]) for o in outs if o and o[-1] in eos]
    out_of_time = sum(o is None for o in outs)
    kept, stats = select_prompts(texts, eval_texts, num_samples, seed=seed)
    return kept, {"sampled": num_samples, "unfinished": num_samples - len(texts), "out_of_time": out_of_time,
                  "too_long": num_samples - len(texts) - out_of_time, **stats}
