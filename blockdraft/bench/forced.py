"""Forced acceptance: a real DFlash step whose drafts are replaced by the known right answer.

With random weights a drafter's acceptance is ~0 (every step commits 1 token), which says nothing
about what DFlash buys once the drafter is trained. This speculator runs the real drafter (same
kernels, same cost, same CUDA graphs) and then overwrites its tokens with the continuation plain
decoding produced, looked up by position, so the verifier accepts every draft that matches the
target: the step cost of DFlash at (near) full acceptance. Every request must share that one
prompt (the benchmark sends N copies), since the lookup is keyed by position only. Output stays
lossless: verification is untouched, drafts are only proposals.
"""

from __future__ import annotations

import torch

from blockdraft.spec.dflash.speculator import DFlashSpeculator


class ForcedAcceptanceSpeculator(DFlashSpeculator):
    """A DFlashSpeculator whose proposals are oracle drafts, after running the real proposal.

    A subclass (not a wrapper) so the engine treats it exactly like DFlash: same backend, same
    KV pool sizing, same CUDA graphs, into which the oracle lookup is captured too.

    Args:
        drafter, target, num_speculative_tokens, num_kv_blocks, kv_block_size, draft_head: as
            DFlashSpeculator (the draft head's cost is paid; its drafts are replaced anyway).
        sequence: [L] int64, prompt + plain-decoding continuation of the single benchmark prompt,
            on the drafter's device. The draft for position p is sequence[p] (positions past the
            end repeat the last token; the engine trims drafts past max_tokens anyway).
    Raises:
        ValueError: an empty or non-1-D sequence, or DFlashSpeculator's errors.
    """

    def __init__(self, drafter, target, num_speculative_tokens, num_kv_blocks, kv_block_size,
                 sequence: torch.Tensor, draft_head=None) -> None:
        if sequence.dim() != 1 or sequence.numel() == 0:
            raise ValueError(f"sequence must be a non-empty 1-D token tensor, got shape {tuple(sequence.shape)}")
        super().__init__(drafter, target, num_speculative_tokens, num_kv_blocks, kv_block_size, draft_head)
        self.sequence = sequence.long()
        # draft k-1 is for position P + k
        self._offsets = torch.arange(1, self.num_speculative_tokens + 1, device=sequence.device)

    @torch.no_grad()
    def propose_block(self, features, positions, slot_mapping, block, block_table):
        """Run DFlashSpeculator.propose_block (context write + draft block + LM head; `propose`
        and the CUDA-graph step both come here), discard its tokens and return [R, K] int64 oracle
        drafts. Tensor ops only: no host sync, so it is captured into the step's tail CUDA graph
        like the real proposal."""
        drafts = super().propose_block(features, positions, slot_mapping, block, block_table)
        if drafts.shape[0] == 0:
            return drafts
        # block.seq_lens holds each request's bonus position P
        index = (block.seq_lens.long()[:, None] + self._offsets[None, :]).clamp(max=self.sequence.numel() - 1)
        return self.sequence[index].to(drafts.dtype)
