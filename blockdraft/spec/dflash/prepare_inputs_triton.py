"""The drafter's input preparation as one Triton launch (after a copy of the slot mapping).

Same signature and outputs as the torch twin `blockdraft.spec.dflash.prepare_inputs.
prepare_draft_inputs` (semantics in that module's docstring); one program per sampling request,
a grid fixed by shapes and no host reads, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.spec.dflash.prepare_inputs import DraftInputs, check_draft_inputs


@triton.jit
def _prepare_draft_inputs_kernel(
    logits_rows_ptr, logits_indices_ptr, num_accepted_ptr, target_ptr, positions_ptr,
    slots_ptr, bonus_ptr, bonus_positions_ptr,
    stride_rows, stride_target, mask_token_id,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, PAD_SLOT: tl.constexpr,
):  # fmt: skip
    """Grid (S,): reject this request's unaccepted draft rows, then write its bonus token and position."""
    s = tl.program_id(0).to(tl.int64)
    column = tl.arange(0, BLOCK_W)
    rows = tl.load(logits_rows_ptr + s * stride_rows + column, mask=column < WIDTH, other=-1).to(tl.int64)
    accepted = tl.load(num_accepted_ptr + s).to(tl.int64)
    forward_row = tl.load(logits_indices_ptr + rows, mask=rows >= 0, other=0).to(tl.int64)
    rejected = (rows >= 0) & (column > accepted)
    tl.store(slots_ptr + forward_row, tl.full([BLOCK_W], PAD_SLOT, tl.int64), mask=rejected)

    anchor = tl.load(logits_rows_ptr + s * stride_rows).to(tl.int64)
    is_real = anchor >= 0
    anchor_row = tl.load(logits_indices_ptr + anchor, mask=is_real, other=0).to(tl.int64)
    anchor_position = tl.load(positions_ptr + anchor_row, mask=is_real, other=0).to(tl.int64)
    target = tl.load(target_ptr + s * stride_target + accepted, mask=is_real, other=0).to(tl.int64)
    bonus = tl.where(is_real, target, mask_token_id)
    bonus_position = tl.where(is_real, anchor_position + 1 + accepted, 0)
    tl.store(bonus_ptr + s, bonus)
    tl.store(bonus_positions_ptr + s, bonus_position)


def prepare_draft_inputs_triton(
    logits_rows: torch.Tensor,
    logits_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    target_tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    mask_token_id: int,
) -> DraftInputs:
    """Triton twin of `prepare_draft_inputs` (same arguments, outputs and errors).

    Launches: a copy of slot_mapping, then one program per sampling request.
    """
    check_draft_inputs(logits_rows, logits_indices, num_accepted, target_tokens, positions, slot_mapping)
    num_sample, width = logits_rows.shape
    # the kernel indexes every tensor as base + offset: contiguous copies where a view is strided (no-ops otherwise)
    logits_rows, target_tokens = logits_rows.contiguous(), target_tokens.contiguous()
    logits_indices, num_accepted, positions = logits_indices.contiguous(), num_accepted.contiguous(), positions.contiguous()
    device = logits_rows.device
    out = DraftInputs(
        context_slot_mapping=slot_mapping.to(torch.long, copy=True),
        bonus_tokens=torch.empty(num_sample, dtype=torch.long, device=device),
        bonus_positions=torch.empty(num_sample, dtype=torch.long, device=device),
    )
    if num_sample == 0:
        return out
    _prepare_draft_inputs_kernel[(num_sample,)](
        logits_rows, logits_indices, num_accepted, target_tokens, positions,
        out.context_slot_mapping, out.bonus_tokens, out.bonus_positions,
        logits_rows.stride(0), target_tokens.stride(0), mask_token_id,
        WIDTH=width, BLOCK_W=triton.next_power_of_2(width), PAD_SLOT=PADDING_SLOT,
    )  # fmt: skip
    return out
