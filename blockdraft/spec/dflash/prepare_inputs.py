"""The drafter's inputs after verification, as sync-free tensor ops (torch twin of the kernel).

After the target forward and verification of one step (DFLASH.md, "One decode step", steps 3-4),
the drafter needs, per sampling request s with anchor row a_s and k_s draft rows:
  * the context slot mapping: the step's slots with the rejected draft rows (column
    c > num_accepted[s] of `logits_rows`) set to PADDING_SLOT, so only committed rows write
    draft KV;
  * the bonus token target[s, num_accepted[s]] at position positions[a_s] + 1 + num_accepted[s],
    the anchor of the next draft block (`DFlashSpeculator.propose` builds the block from it).
This module computes them with tensor ops only (no boolean-mask indexing, no `.item()`), so it
runs inside a CUDA graph; `blockdraft.spec.dflash.prepare_inputs_triton` is the one-launch
Triton kernel with the same outputs. Reference math: the same with boolean-mask indexing
(`rows[rejected]`, a host sync), kept frozen in tests/spec/test_prepare_inputs.py.

Padding sampling requests (logits_rows[s, 0] == -1, e.g. in a CUDA-graph bucket) reject nothing
and get bonus token `mask_token_id` at position 0, so their draft block is valid embedding input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import PADDING_SLOT


@dataclass
class DraftInputs:
    """Outputs of `prepare_draft_inputs` (S sampling requests, T forward rows).

    Attributes:
        context_slot_mapping: [T] int64, the step's slot_mapping with rejected draft rows set to
            PADDING_SLOT (the drafter writes context K/V of committed rows only).
        bonus_tokens: [S] int64, target[s, num_accepted[s]].
        bonus_positions: [S] int64, position of the anchor row + 1 + num_accepted[s].
    """

    context_slot_mapping: torch.Tensor
    bonus_tokens: torch.Tensor
    bonus_positions: torch.Tensor


def check_draft_inputs(
    logits_rows: torch.Tensor,
    logits_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    target_tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Shape checks shared by the twin and the kernel (shapes only: no device values are read).

    Raises:
        ValueError: a tensor of the wrong rank or length.
    """
    num_sample, width = logits_rows.shape if logits_rows.dim() == 2 else (-1, -1)
    if width < 1:
        raise ValueError(f"logits_rows must be [S, kmax + 1] with kmax >= 0, got {tuple(logits_rows.shape)}")
    if target_tokens.shape != logits_rows.shape:
        raise ValueError(
            f"target_tokens {tuple(target_tokens.shape)} must match logits_rows {tuple(logits_rows.shape)}"
        )
    if num_accepted.shape != (num_sample,):
        raise ValueError(f"num_accepted {tuple(num_accepted.shape)} must be [{num_sample}]")
    if logits_indices.dim() != 1:
        raise ValueError(f"logits_indices must be 1-D [L], got {tuple(logits_indices.shape)}")
    if positions.dim() != 1 or slot_mapping.shape != positions.shape:
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must both be [T]"
        )


def prepare_draft_inputs(
    logits_rows: torch.Tensor,
    logits_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    target_tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    mask_token_id: int,
) -> DraftInputs:
    """Context slots and bonus tokens / positions of one step (module docstring).

    Args:
        logits_rows: [S, kmax + 1] int, per sampling request the logits-row index of its anchor
            (column 0) and draft rows (columns 1..k_s), -1 = padding.
        logits_indices: [L] int, forward row of each logits row.
        num_accepted: [S] int, accepted drafts per request (0..k_s).
        target_tokens: [S, kmax + 1] int, the target's token at each of those rows.
        positions: [T] int, position of each forward row.
        slot_mapping: [T] int64, cache slot of each forward row (PADDING_SLOT = none).
        mask_token_id: the drafter's MASK token (the bonus of padding requests).
    Returns:
        DraftInputs (shapes in its docstring); inputs are not modified.
    Raises:
        ValueError: see `check_draft_inputs`.
    """
    check_draft_inputs(logits_rows, logits_indices, num_accepted, target_tokens, positions, slot_mapping)
    num_rows = slot_mapping.shape[0]
    rows = logits_rows.long()
    accepted = num_accepted.long()
    # Padding columns map to forward row T, a scratch entry appended to each [T] tensor, so every
    # gather and scatter stays in bounds without a data-dependent shape.
    row_of = torch.cat([logits_indices.long(), logits_indices.new_full((1,), num_rows, dtype=torch.long)])
    forward_row = row_of[torch.where(rows >= 0, rows, logits_indices.shape[0])]  # [S, kmax + 1]
    column = torch.arange(rows.shape[1], device=rows.device)
    rejected = (rows >= 0) & (column[None, :] > accepted[:, None])
    slots = torch.cat([slot_mapping.long(), slot_mapping.new_zeros(1, dtype=torch.long)])
    slots.index_fill_(0, torch.where(rejected, forward_row, num_rows).flatten(), PADDING_SLOT)

    is_real = rows[:, 0] >= 0
    bonus = target_tokens.long().gather(1, accepted[:, None]).squeeze(1)
    bonus = torch.where(is_real, bonus, mask_token_id)
    anchor_position = torch.cat([positions.long(), positions.new_zeros(1, dtype=torch.long)])[forward_row[:, 0]]
    bonus_positions = torch.where(is_real, anchor_position + 1 + accepted, 0)
    return DraftInputs(context_slot_mapping=slots[:num_rows], bonus_tokens=bonus, bonus_positions=bonus_positions)


def draft_input_preparer(backend_name: str):
    """`prepare_draft_inputs_triton` (one launch) next to the Triton attention backend, else the
    torch twin `prepare_draft_inputs` (same arguments and outputs)."""
    if backend_name == "triton":
        from blockdraft.spec.dflash.prepare_inputs_triton import prepare_draft_inputs_triton

        return prepare_draft_inputs_triton
    return prepare_draft_inputs
