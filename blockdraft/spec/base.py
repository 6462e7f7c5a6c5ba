"""The speculator protocol: what the model runner needs from any drafter (DFlash today).

One decode step (DFLASH.md "One decode step"): the runner asks the target forward to capture the
hidden states at `aux_layer_ids`, verifies, commits, then calls `propose` with the captured
features of this step's rows and the new bonus tokens, and gets the next drafts back.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Speculator(Protocol):
    """A drafter behind a fixed-shape propose call.

    Attributes:
        num_speculative_tokens: K, drafts proposed per request per step.
        aux_layer_ids: target decoder layers whose outputs the target forward must capture and
            concatenate (in this order) into `features` [T, n*H].
    """

    num_speculative_tokens: int
    aux_layer_ids: tuple[int, ...]

    def propose(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        bonus_tokens: torch.Tensor,
        bonus_positions: torch.Tensor,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """Absorb the committed rows' features and return drafts [R, K] int64 (see DFlashSpeculator).

        A speculator that also has `write_context(features, positions, slot_mapping)` (absorb
        without drafting) supports the runner's disable_by_batch_size."""
        ...
