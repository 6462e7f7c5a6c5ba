"""Our engine through the public API: `LLM(target=..., speculator=..., device=...).generate`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from blockdraft.bench.engines import DFLASH, FORCED, PLAIN, Generation
from blockdraft.engine.feed import feed_requests
from blockdraft.engine.request import SpecStats
from blockdraft.llm import LLM
from blockdraft.model_loader import LoadedTarget
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
            outs = feed_requests(self.llm.engine, prompts, params, concurrency, id_prefix="bench")
        pooled = SpecStats()
        for o in outs:
            pooled.merge(o.spec)
        return Generation(
            token_ids=[list(o.token_ids) for o in outs],
            num_steps=self.llm.engine.stats.num_steps - before,
            acceptance_length=pooled.acceptance_length if self.mode != PLAIN else None,
        )


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
