"""A padded uniform step's verification, drafter input preparation and draft block in one launch.

Same arguments and outputs as the torch twin `blockdraft.spec.dflash.draft_block.
uniform_step_inputs` (semantics in that module's docstring): one program per request of the
bucket, a grid fixed by shapes and no host reads, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.spec.dflash.draft_block import DraftBlock, check_uniform_step


@triton.jit
def _uniform_step_inputs_kernel(
    target_ptr, input_ids_ptr, row_req_ptr, positions_ptr, slots_ptr, qsl_ptr,
    accepted_ptr, context_slots_ptr, block_ids_ptr, block_positions_ptr, seq_lens_ptr, block_qsl_ptr,
    block_row_req_ptr, block_slots_ptr,
    stride_target, mask_token_id,
    Q: tl.constexpr, B: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr, PAD_SLOT: tl.constexpr,
):  # fmt: skip
    """Grid (R,): request r's accepted count, context slots, bonus and draft block rows."""
    r = tl.program_id(0).to(tl.int64)
    column = tl.arange(0, BLOCK_Q)
    in_row = column < Q
    target = tl.load(target_ptr + r * stride_target + column, mask=in_row, other=0).to(tl.int64)
    # column c holds the draft for row c + 1 of the request (input_ids [anchor, drafts])
    is_draft = column < Q - 1
    draft = tl.load(input_ids_ptr + r * Q + 1 + column, mask=is_draft, other=0).to(tl.int64)
    # accepted = the first column whose draft differs from the target's token (K when none does)
    stop = tl.where(is_draft & (draft == target), BLOCK_Q + Q, column)
    accepted = tl.minimum(tl.min(stop, axis=0), Q - 1).to(tl.int64)
    tl.store(accepted_ptr + r, accepted)

    row_req = tl.load(row_req_ptr + r * Q + column, mask=in_row, other=-1)
    slots = tl.load(slots_ptr + r * Q + column, mask=in_row, other=0).to(tl.int64)
    rejected = (row_req >= 0) & (column > accepted)
    tl.store(context_slots_ptr + r * Q + column, tl.where(rejected, PAD_SLOT, slots), mask=in_row)

    request = tl.load(row_req_ptr + r * Q)
    is_real = request >= 0
    bonus_target = tl.sum(tl.where(column == accepted, target, 0), axis=0)
    bonus = tl.where(is_real, bonus_target, mask_token_id)
    anchor_position = tl.load(positions_ptr + r * Q).to(tl.int64)
    bonus_position = tl.where(is_real, anchor_position + 1 + accepted, 0)
    tl.store(seq_lens_ptr + r, bonus_position.to(tl.int32))

    slot = tl.arange(0, BLOCK_B)
    in_block = slot < B
    row = r * B + slot
    tl.store(block_ids_ptr + row, tl.where(slot == 0, bonus, mask_token_id), mask=in_block)
    tl.store(block_positions_ptr + row, bonus_position + slot, mask=in_block)
    tl.store(block_row_req_ptr + row, tl.zeros([BLOCK_B], tl.int32) + request, mask=in_block)
    tl.store(block_slots_ptr + row, tl.full([BLOCK_B], PAD_SLOT, tl.int64), mask=in_block)
    # query ranges start at multiples of Q (padding requests empty): the same starts times B / Q
    tl.store(block_qsl_ptr + r + 1, tl.load(qsl_ptr + r + 1) // Q * B)
    if r == 0:
        tl.store(block_qsl_ptr, tl.load(qsl_ptr) // Q * B)


def uniform_step_inputs_triton(
    target: torch.Tensor,
    input_ids: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_block_tokens: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, DraftBlock]:
    """Triton twin of `uniform_step_inputs` (same arguments, outputs and errors), one launch.

    Expects the dtypes the target graphs' static buffers have (target / input_ids / positions /
    slot_mapping int64, row_req / query_start_loc int32); contiguous copies are made of strided views.
    """
    check_uniform_step(target, input_ids, row_req, positions, slot_mapping, query_start_loc, num_block_tokens)
    num_reqs, q = target.shape
    b, device = num_block_tokens, target.device
    target, input_ids, row_req = target.contiguous(), input_ids.contiguous(), row_req.contiguous()
    positions, slot_mapping, query_start_loc = positions.contiguous(), slot_mapping.contiguous(), query_start_loc.contiguous()
    num_accepted = torch.empty(num_reqs, dtype=torch.long, device=device)
    context_slots = torch.empty(num_reqs * q, dtype=torch.long, device=device)
    block = DraftBlock(
        num_block_tokens=b,
        token_ids=torch.empty(num_reqs * b, dtype=torch.long, device=device),
        positions=torch.empty(num_reqs * b, dtype=torch.long, device=device),
        seq_lens=torch.empty(num_reqs, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(num_reqs + 1, dtype=torch.int32, device=device) if num_reqs == 0
        else torch.empty(num_reqs + 1, dtype=torch.int32, device=device),
        row_req=torch.empty(num_reqs * b, dtype=torch.int32, device=device),
        slot_mapping=torch.empty(num_reqs * b, dtype=torch.long, device=device),
    )
    if num_reqs == 0:
        return num_accepted, context_slots, block
    _uniform_step_inputs_kernel[(num_reqs,)](
        target, input_ids, row_req, positions, slot_mapping, query_start_loc,
        num_accepted, context_slots, block.token_ids, block.positions, block.seq_lens, block.query_start_loc,
        block.row_req, block.slot_mapping,
        target.stride(0), mask_token_id,
        Q=q, B=b, BLOCK_Q=triton.next_power_of_2(q), BLOCK_B=triton.next_power_of_2(b), PAD_SLOT=PADDING_SLOT,
    )  # fmt: skip
    return num_accepted, context_slots, block
