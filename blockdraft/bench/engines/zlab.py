"""The z-lab reference (`dflash==0.1.0`, `dflash.model.dflash_generate`) as a baseline.

`dflash_generate` decodes ONE request ([1, L] input; its acceptance bookkeeping reads element 0),
so this engine reports every batch size above 1 as unsupported. Plain decoding is the same loop
with block_size=1 (what z-lab's own benchmark uses as its baseline); DFlash uses block_size =
K + 1 with the same drafter weights as ours.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings

import torch

from blockdraft.bench.engines import DFLASH, PLAIN, Generation


class ZLabEngine:
    """z-lab `dflash_generate` over an HF target and z-lab's DFlashDraftModel.

    Args:
        drafter: z-lab DFlashDraftModel (see bench.random_weights.zlab_drafter_from); also needed
            for plain decoding, whose output buffer is initialised with its mask token.
        target: the HF *ForCausalLM (the same object the HF baseline runs).
        block_size: 1 = plain decoding; K + 1 = DFlash with K drafts per step.
    Raises:
        ValueError: block_size < 1.
    """

    engine = "zlab"

    def __init__(self, drafter, target, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"z-lab block_size must be >= 1, got {block_size}")
        self.drafter, self.target, self.block_size = drafter, target, block_size
        self.mode = PLAIN if block_size == 1 else DFLASH

    def unsupported(self, batch_size: int) -> str | None:
        if batch_size > 1:
            return "dflash_generate decodes one request at a time"
        return None

    def generate(self, prompts: list[list[int]], max_tokens: int, concurrency: int | None = None) -> Generation:
        """Runs `dflash_generate(..., temperature=0, stop_token_ids=None)` on each prompt in turn
        (one request in flight); acceptance pooled over every verify step.

        Raises:
            ValueError: several prompts at once (concurrency None or > 1).
        """
        if len(prompts) > 1 and concurrency != 1:
            raise ValueError(f"z-lab dflash_generate decodes one request at a time: {len(prompts)} prompts need "
                             f"concurrency=1, got {concurrency}")
        tokens, num_steps, accepted = [], 0, []
        for prompt in prompts:
            out, steps = self._one(prompt, max_tokens)
            tokens.append(out)
            num_steps += 1 + len(steps)
            accepted += steps
        acceptance = statistics.fmean(accepted) if self.block_size > 1 and accepted else None
        return Generation(token_ids=tokens, num_steps=num_steps, acceptance_length=acceptance)

    def _one(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """(output token ids, acceptance length of each verify step) of one request."""
        from dflash import model as zlab

        ids = torch.tensor([prompt], dtype=torch.long, device=self.target.device)
        with _host_timer_off_cuda(zlab, ids.device), warnings.catch_warnings():
            # the reference passes past_key_values, which transformers >= 5.x deprecates: its noise, not ours
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            res = zlab.dflash_generate(
                self.drafter, self.target, ids, max_tokens, None,
                temperature=0.0, block_size=self.block_size, return_stats=True,
            )
        return res.output_ids[0, ids.shape[1] :].tolist(), list(res.acceptance_lengths)


@contextlib.contextmanager
def _host_timer_off_cuda(zlab_module, device: torch.device):
    """dflash_generate's stats timer calls torch.cuda.synchronize(); off CUDA use a host clock."""
    if device.type == "cuda":
        yield
        return
    saved = zlab_module._cuda_time
    zlab_module._cuda_time = time.perf_counter
    try:
        yield
    finally:
        zlab_module._cuda_time = saved
