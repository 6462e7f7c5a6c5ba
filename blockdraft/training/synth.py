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

# Request openers (gpu_run --synth-openers general; train-drafter's --synth-openers, general by
# default): from the bare pre-query template a coder model writes mostly coding requests, and in
# session 30 a quarter of Qwen2.5-Coder's were dropped by the ASCII filter; a first English word or
# two steers the samples towards the other kinds of chat turn
# (writing, explaining, role play, math, extraction). Chosen to cover the kinds of request MT-bench
# asks, so many of its prompts begin with one of these words too (read an MT-bench gain with that
# in mind); the requests still pass the eval-overlap filter. "" keeps a share of bare samples.
GENERAL_OPENERS = ("", "Write", "Explain", "How do", "What is", "Can you", "Compose", "Imagine you are",
                   "Describe", "Solve", "Summarize", "Extract", "Compare", "Suggest", "Why", "Give me",
                   "Rewrite", "Plan", "Help me", "Tell me")


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
    openers: tuple[str, ...] | list[str] = ("",), generate=None,
) -> tuple[list[str], dict]:
    """User requests written by `llm`'s target from its pre-query template, filtered.

    Args:
        llm: blockdraft.llm.LLM on the target (its tokenizer and engine are used).
        num_samples: requests to sample (seed `seed + i` for sample i).
        eval_texts: evaluation prompts a training prompt must not overlap (corpora.all_eval_texts).
        max_tokens: samples that reach this length without ending their turn are dropped.
        deadline: wall-clock time (time.time() seconds) after which sampling stops (generate_with_engine).
        openers: sample i starts its request with openers[i % len(openers)] (written after the
            pre-query template, kept in the request's text); ("",): plain Magpie. GENERAL_OPENERS
            steers a coder model towards other kinds of requests.
        generate: samples the requests instead of generate_with_engine(llm, ..., deadline=deadline):
            called as generate(prompt_ids, max_tokens, sampled, temperature, seed), it returns one
            token id list (or None: not done) per prompt, the sample of prompt i seeded `seed + i`
            (train-drafter's journaled, interruptible answering: training/answer_journal.py).
    Returns:
        (texts, stats): the kept requests (deduplicated, eval-free, shuffled with `seed`) and counts:
        sampled; unfinished (no end of turn) = out_of_time (not done by the deadline) + too_long
        (reached max_tokens); then the select_prompts filters.

    Raises:
        ValueError: openers is not a non-empty list or tuple, or one of them is not a string or ends
            in whitespace (it would end on a lone space token, which the target rarely writes;
            names its index and value).
    """
    if not isinstance(openers, (list, tuple)) or not openers:
        raise ValueError(f"openers must be a non-empty list of strings ('' for none), got {type(openers).__name__} "
                         f"{str(openers)[:80]!r}")
    for i, o in enumerate(openers):
        if not isinstance(o, str):
            raise ValueError(f"openers[{i}] must be a str, got {type(o).__name__} {str(o)[:80]!r}")
        if o != o.rstrip():
            raise ValueError(f"openers[{i}] ends in whitespace: {o[:80]!r}; give it without (the target writes "
                             "the space before its next word itself)")
    tok = llm.tokenizer
    eos = set(llm.engine.eos_token_ids)
    pre = pre_query_ids(tok)
    starts = [tok.encode(o, add_special_tokens=False) if o else [] for o in openers]
    first = [starts[i % len(starts)] for i in range(num_samples)]
    if generate is None:
        def generate(prompt_ids, max_new_tokens, sampled, temp, first_seed):
            return generate_with_engine(llm, prompt_ids, max_new_tokens, sampled, temp, first_seed, progress=progress,
                                        deadline=deadline)
    outs = generate([pre + s for s in first], max_tokens, [True] * num_samples, temperature, seed)
    texts = [tok.decode(s + o[:-1]) for s, o in zip(first, outs) if o and o[-1] in eos]
    out_of_time = sum(o is None for o in outs)
    kept, stats = select_prompts(texts, eval_texts, num_samples, seed=seed)
    return kept, {"sampled": num_samples, "unfinished": num_samples - len(texts), "out_of_time": out_of_time,
                  "too_long": num_samples - len(texts) - out_of_time, **stats}
