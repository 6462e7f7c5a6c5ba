"""Forced acceptance: a real DFlash step whose drafts are replaced by the known right answer.

With random weights a drafter's acceptance is ~0 (every step commits 1 token), which says nothing
about what DFlash buys once the drafter is trained. This wrapper runs the real drafter (same
kernels, same cost) and then overwrites its tokens with the continuation plain decoding produced,
looked up by position, so the verifier accepts every draft that matches the target: the step cost
of DFlash at (near) full acceptance. Every request must share that one prompt (the benchmark sends
N copies), since the lookup is keyed by position only. Output stays lossless: verification is
untouched, drafts are only proposals.
"""

from __future__ import annotations

import torch


class ForcedAcceptanceSpeculator:
    """Wraps a speculator (e.g. DFlashSpeculator); `propose` runs it, then returns oracle drafts.

    Args:
        inner: the real speculator (its attributes are forwarded: aux_layer_ids, kv_caches, ...).
        sequence: [L] int64, prompt + plain-decoding continuation of the single benchmark prompt,
            on the inner speculator's device. The draft for position p is sequence[p] (positions
            past the end repeat the last token, which the engine trims before max_tokens anyway).
    Raises:
        ValueError: an empty or non-1-D sequence.
    """

    def __init__(self, inner, sequence: torch.Tensor) -> None:
        if sequence.dim() != 1 or sequence.numel() == 0:
            raise ValueError(f"sequence must be a non-empty 1-D token tensor, got shape {tuple(sequence.shape)}")
        self.inner = inner
        self.sequence = sequence.long()
        offsets = torch.arange(1, inner.num_speculative_tokens + 1, device=sequence.device)
        self._offsets = offsets  # draft k-1 is for position P + k

    def __getattr__(self, name: str):
        # Only reached for attributes not set in __init__: forward them to the wrapped speculator.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, features, positions, slot_mapping, bonus_tokens, bonus_positions, block_table) -> torch.Tensor:
        """Run the real proposal (context write + draft block), discard its tokens, return
        [R, K] int64 oracle drafts. Tensor ops only: no host sync, safe under CUDA graph capture."""
        drafts = self.inner.propose(features, positions, slot_mapping, bonus_tokens, bonus_positions, block_table)
        if drafts.shape[0] == 0:
            return drafts
        index = (bonus_positions.long()[:, None] + self._offsets[None, :]).clamp(max=self.sequence.numel() - 1)
        return self.sequence[index].to(drafts.dtype)
