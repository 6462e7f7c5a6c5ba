"""Our engine through the public API: `LLM(target=..., speculator=..., device=...).generate`."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch

from blockdraft.bench.engines import DFLASH, FORCED, PLAIN, Generation
from blockdraft.engine.gc_heap import frozen_gc_heap
from blockdraft.engine.request import SpecStats
from blockdraft.llm import LLM, LoadedTarget
from blockdraft.sampling_params import SamplingParams


@dataclass(frozen=True)
class PoolPlan:
    """KV pool and scheduler sizes that fit the largest batch without preemption.

    max_batch: concurrent requests. max_prompt_len / max_tokens: longest prompt and output.
    lookahead: extra slots a request may hold past its output (drafts being verified: K + 1).
    kv_block_size: tokens per page.
    """

    max_batch: int
    max_prompt_len: int
    max_tokens: int
    lookahead: int = 0
    kv_block_size: int = 16

    @property
    def num_kv_blocks(self) -> int:
        """Pages for every request at full length, plus one spare page per request."""
        per_request = -(-(self.max_prompt_len + self.max_tokens + self.lookahead) // self.kv_block_size) + 1
        return self.max_batch * per_request

    @property
    def max_num_batched_tokens(self) -> int:
        """All prompts prefill in one step (so the prefill-only run isolates exactly the prefill)."""
        return max(512, self.max_batch * max(self.max_prompt_len, self.lookahead + 1))


def check_llm_options(options: dict) -> dict:
    """Keep the LLM keyword options the installed engine accepts (e.g. enforce_eager,
    attention_backend of the CUDA runner); None values mean "not given" and are dropped.

    Raises:
        ValueError: a given option this build's `LLM` does not take (names it and the accepted ones).
    """
    accepted = set(inspect.signature(LLM.__init__).parameters) - {"self"}
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ValueError(f"this build's LLM does not take {unknown}; it accepts {sorted(accepted)}")
    return given


class OurEngine:
    """Our continuous-batching engine, plain or with a DFlash speculator.

    Args:
        target: the loaded target (shared by every LLM of the benchmark).
        device: torch device string of the target.
        plan: pool and scheduler sizes.
        speculator: None (plain), a DFlashSpeculator, or a ForcedAcceptanceSpeculator.
        mode: PLAIN | DFLASH | FORCED (labels the results).
        options: extra LLM keyword options, already checked by `check_llm_options`.
    """

    engine = "ours"

    def __init__(self, target: LoadedTarget, device: str, plan: PoolPlan, speculator=None, mode: str = PLAIN,
                 options: dict | None = None) -> None:
        if (speculator is None) != (mode == PLAIN):
            raise ValueError(f"mode {mode!r} does not match speculator {type(speculator).__name__}")
        self.mode = mode
        self.max_batch = plan.max_batch
        self.llm = LLM(
            target=target, speculator=speculator, device=device, kv_block_size=plan.kv_block_size,
            num_kv_blocks=plan.num_kv_blocks, max_num_seqs=plan.max_batch,
            max_num_batched_tokens=plan.max_num_batched_tokens, **(options or {}),
        )

    def unsupported(self, batch_size: int) -> str | None:
        if batch_size > self.max_batch:
            return f"the KV pool was sized for {self.max_batch} concurrent requests"
        return None

    def generate(self, prompts: list[list[int]], max_tokens: int, concurrency: int | None = None) -> Generation:
        """Greedy decoding at T=0 with ignore_eos; steps = engine steps this call ran.

        All prompts at once through `LLM.generate`, or, with `concurrency` below the number of
        prompts, as a client that keeps at most `concurrency` requests in the engine and sends the
        next prompt when one finishes (vLLM's `benchmark_serving --max-concurrency`).
        """
        before = self.llm.engine.stats.num_steps
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if concurrency is None or concurrency >= len(prompts):
            outs = self.llm.generate(prompts, params)
        else:
            outs = generate_windowed(self.llm.engine, prompts, params, concurrency)
        pooled = SpecStats()
        for o in outs:
            pooled.merge(o.spec)
        return Generation(
            token_ids=[list(o.token_ids) for o in outs],
            num_steps=self.llm.engine.stats.num_steps - before,
            acceptance_length=pooled.acceptance_length if self.mode != PLAIN else None,
        )


_WINDOWED_CALLS = itertools.count()  # request ids stay unique across calls on one engine


def generate_windowed(engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> list:
    """Final RequestOutputs of `prompts` in input order, at most `concurrency` in the engine at once.

    As `LLM.generate`: every prompt is checked before any is queued, and the step loop runs with
    the garbage collector's heap frozen (engine/gc_heap.py), so both paths are timed alike. On an
    error the requests still in the engine are aborted, so the next cell starts from an empty one.
    Raises:
        ValueError: a prompt the engine refuses (engine.check_request), nothing queued then.
        RuntimeError: the engine ran dry while requests of this call had no final output.
    """
    for prompt in prompts:
        engine.check_request(prompt, params)
    call = next(_WINDOWED_CALLS)
    out: list = [None] * len(prompts)
    index: dict[str, int] = {}
    fed = 0
    try:
        with frozen_gc_heap():
            while fed < len(prompts) or index:
                while fed < len(prompts) and len(index) < concurrency:
                    rid = f"bench-{call}-{fed}"
                    engine.add_request(rid, prompts[fed], params)
                    index[rid] = fed
                    fed += 1
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no unfinished requests but {len(index)} of this call's "
                                       f"have no final output")
                for o in engine.step(stream=False):
                    if o.finished and o.request_id in index:
                        out[index.pop(o.request_id)] = o
    except BaseException:
        for rid in index:  # stopped and their pages freed at once (LLMEngine.abort_request)
            engine.abort_request(rid)
        raise
    return out


def dflash_speculator(drafter, target: LoadedTarget, plan: PoolPlan, num_speculative_tokens: int | None,
                      draft_head=None):
    """A DFlashSpeculator for `drafter` over `target`, its draft cache sized like the target's
    (draft_head: its draft vocabulary, None = full)."""
    from blockdraft.spec.dflash.speculator import DFlashSpeculator

    return DFlashSpeculator(drafter, target.model, num_speculative_tokens, plan.num_kv_blocks, plan.kv_block_size,
                            draft_head)


def forced_speculator(drafter, target: LoadedTarget, plan: PoolPlan, num_speculative_tokens: int | None,
                      sequence: list[int], device: str, draft_head=None):
    """A ForcedAcceptanceSpeculator (bench/forced.py): DFlash over `drafter` replaying `sequence`."""
    from blockdraft.bench.forced import ForcedAcceptanceSpeculator

    seq = torch.tensor(sequence, dtype=torch.long, device=device)
    return ForcedAcceptanceSpeculator(drafter, target.model, num_speculative_tokens, plan.num_kv_blocks,
                                      plan.kv_block_size, seq, draft_head)


__all__ = ["DFLASH", "FORCED", "PLAIN", "OurEngine", "PoolPlan", "check_llm_options", "dflash_speculator",
           "forced_speculator"]
