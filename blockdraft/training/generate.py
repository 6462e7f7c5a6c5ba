"""Answer training prompts BY THE TARGET (DFLASH.md "Training": target-regenerated responses).

Two back ends produce the same kind of data (token ids of prompt and response, EOS included when
the target stopped):
- `generate_with_engine`: our engine (`blockdraft.llm.LLM.generate`), continuous batching; the
  default and the CPU path.
- `generate_with_hf`: transformers `generate` on the same converted weights, batched with left
  padding (the GPU runs of sessions 1-5; `gpu_run --gen-engine` now uses our engine there too).
A `sampled_fraction` of the prompts is answered at temperature T with a per-prompt (engine) or
per-batch (HF) seed; the rest greedily.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from blockdraft.training.dataset import TokenDataset


def encode_prompts(tokenizer, texts: list, max_prompt_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Chat-encode each prompt (a text: one user turn; or a chat message list) with the assistant
    cue, dropping prompts longer than `max_prompt_tokens`. Returns (token id lists, indices of the
    kept prompts)."""
    out, kept = [], []
    for i, text in enumerate(texts):
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(chat, add_special_tokens=False)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
            kept.append(i)
    return out, kept


def sampling_plan(n: int, sampled_fraction: float, seed: int) -> list[bool]:
    """Which of n prompts are answered by sampling (a seeded `sampled_fraction` share)."""
    rng = random.Random(seed)
    k = round(n * sampled_fraction)
    chosen = set(rng.sample(range(n), k)) if k else set()
    return [i in chosen for i in range(n)]


def generate_with_engine(
    llm, prompt_ids: list[list[int]], max_new_tokens: int, sampled: list[bool], temperature: float = 0.7,
    seed: int = 0, progress: bool = False, deadline: float | None = None,
    should_stop: Callable[[], bool] | None = None, on_finished: Callable[[], None] | None = None,
) -> list[list[int] | None]:
    """Responses from our engine: greedy, or sampled at `temperature` with seed `seed + i` for prompt i.

    Each response is the generated token ids, EOS included when the target stopped. With a
    wall-clock `deadline` (time.time() seconds) or a `should_stop` callable (checked before each
    engine step), prompts are fed to the engine in order, a few more than it runs at once, and
    when the deadline passes or should_stop() returns True the unfinished ones are aborted: their
    entries are None (as `generate_with_hf`). `on_finished` (no argument) is called as each prompt
    is answered, on that path too. Without any of the three, every prompt is answered
    (`LLM.generate`).
    """
    from blockdraft.sampling_params import SamplingParams

    params = [  # token ids only: no text is decoded
        SamplingParams(
            max_tokens=max_new_tokens, temperature=temperature if s else 0.0, seed=seed + i, detokenize=False
        )
        for i, s in enumerate(sampled)
    ]
    if deadline is None and should_stop is None and on_finished is None:
        outs = llm.generate(prompt_ids, params, use_tqdm=progress)
        return [list(o.token_ids) for o in outs]
    return _generate_until(llm.engine, prompt_ids, params, deadline, progress, should_stop, on_finished)


def _generate_until(engine, prompt_ids: list[list[int]], params: list, deadline: float | None, progress: bool,
                    should_stop: Callable[[], bool] | None = None,
                    on_finished: Callable[[], None] | None = None) -> list[list[int] | None]:
    """Drive `engine` over the prompts until all are answered, `deadline` passes or should_stop()
    (see generate_with_engine). The waiting queue is kept short (2x max_num_seqs in flight) so that
    aborting touches few requests."""
    from tqdm.auto import tqdm

    from blockdraft.engine.feed import feed_requests

    bar = tqdm(total=len(prompt_ids), desc="generate", unit="req", disable=not progress)

    def finished(_) -> None:
        bar.update(1)
        if on_finished is not None:
            on_finished()

    try:
        outs = feed_requests(engine, prompt_ids, params, 2 * engine.scheduler.config.max_num_seqs, deadline=deadline,
                             should_stop=should_stop, id_prefix="answer", on_finished=finished)
    finally:
        bar.close()
    return [None if o is None else list(o.token_ids) for o in outs]


@torch.no_grad()
def generate_with_hf(
    model, prompt_ids: list[list[int]], max_new_tokens: int, sampled: list[bool], eos_ids: tuple[int, ...],
    pad_id: int, temperature: float = 0.7, seed: int = 0, batch_size: int = 256, progress: bool = False,
    deadline: float | None = None,
) -> list[list[int] | None]:
    """Responses from transformers `generate` (left-padded batches of similar prompt length).

    Greedy and sampled prompts go to separate batches, run in a seeded random order; batch j uses
    torch.manual_seed(seed + j) (sampled batches). Each response is cut after its first EOS (kept)
    and has no padding. No batch starts after the wall-clock `deadline` (time.time() seconds):
    prompts left unanswered get None.
    """
    import time

    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    out: list[list[int] | None] = [None] * len(prompt_ids)
    groups = [[i for i, s in enumerate(sampled) if s == flag] for flag in (False, True)]
    batches = []
    for flag, idx in zip((False, True), groups):
        idx = sorted(idx, key=lambda i: len(prompt_ids[i]))
        batches += [(flag, idx[j : j + batch_size]) for j in range(0, len(idx), batch_size)]
    random.Random(seed).shuffle(batches)
    for j, (flag, idx) in enumerate(tqdm(batches, desc="generate", disable=not progress)):
        if deadline is not None and time.time() > deadline:
            break
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompt_ids[i]) :] = torch.tensor(prompt_ids[i])
            mask[r, width - len(prompt_ids[i]) :] = 1
        kwargs = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if flag else dict(do_sample=False)
        if flag:
            torch.manual_seed(seed + j)
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids), pad_token_id=pad_id, **kwargs,
        )
        for r, i in enumerate(idx):
            out[i] = cut_at_eos(gen[r, width:].tolist(), eos_ids)
    return out


def cut_at_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """`tokens` up to and including the first EOS (all of them if there is none)."""
    for k, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: k + 1]
    return tokens


def to_dataset(prompt_ids: list[list[int]], responses: list, sampled: list[bool], info: dict) -> TokenDataset:
    """Pack (prompt, response) pairs, dropping empty or missing (None) responses; info gets the counts."""
    keep = [i for i, r in enumerate(responses) if r]
    data = TokenDataset.from_pairs([(prompt_ids[i], responses[i]) for i in keep], [sampled[i] for i in keep], info)
    data.info.update(num_sequences=len(data), num_tokens=int(data.offsets[-1]),
                     num_response_tokens=data.num_response_tokens(), num_sampled=int(data.sampled.sum()))
    return data
