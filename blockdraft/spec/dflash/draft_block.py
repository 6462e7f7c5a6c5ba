"""The draft block's inputs, and the whole post-verify preparation of a uniform step in one call.

A DFlash draft block per request is [bonus, MASK x (B - 1)] at positions P..P+B-1, where P is the
bonus token's position and the drafter's context is every cached position < P (DFLASH.md "One
decode step", steps 3-4). `DraftBlock` holds those rows and the layout the drafter's attention
needs; `build_draft_block` makes it from bonus tokens and positions with tensor ops (any caller).

`uniform_step_inputs` is the torch twin of the padded uniform step's tail before the drafter
runs (runner.step_tail): verification (spec.verify), the drafter's input preparation
(spec.dflash.prepare_inputs) and the block above, over the target graphs' static buffers.
`blockdraft.spec.dflash.draft_block_triton` computes the same in one launch: in a batch-1 DFlash
step these were ~20 small kernels (~1.7 us each plus the gaps between them in a CUDA-graph replay;
docs/benchmarks/gpu.md, "Session 31").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import PADDING_SLOT, AttentionMetadata
from blockdraft.spec.dflash.prepare_inputs import prepare_draft_inputs
from blockdraft.spec.verify import verify_drafts


@dataclass
class DraftBlock:
    """R requests x B block rows, request r owning rows query_start_loc[r]..query_start_loc[r+1]-1.

    Attributes:
        num_block_tokens: B.
        token_ids: [R*B] int64, per request its bonus token then B - 1 MASK tokens.
        positions: [R*B] int64, P_r + 0..B-1.
        seq_lens: [R] int32, P_r: the cached context each request's block attends to.
        query_start_loc: [R + 1] int32 (padding requests of a CUDA-graph bucket: empty ranges).
        row_req: [R*B] int32, request index of each row, -1 for rows of padding requests.
        slot_mapping: [R*B] int64, all PADDING_SLOT: the block's own K/V never enters the cache
            (the next step writes these positions from target features instead).
    """

    num_block_tokens: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    row_req: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def attention_metadata(self, block_table: torch.Tensor, kv_block_size: int, host_lists: bool) -> AttentionMetadata:
        """Block-mode metadata over `block_table` [R, M] int32 (the target's pages).

        host_lists: also fill the host copies of query_start_loc / seq_lens (the torch reference
        backend; reads them back to the host). False on the sync-free GPU path."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=block_table,
            slot_mapping=self.slot_mapping,
            kv_block_size=kv_block_size,
            query_start_loc_host=self.query_start_loc.tolist() if host_lists else None,
            seq_lens_host=self.seq_lens.tolist() if host_lists else None,
            num_block_tokens=self.num_block_tokens,
            row_req=self.row_req,
        )


def build_draft_block(
    bonus_tokens: torch.Tensor,
    bonus_positions: torch.Tensor,
    num_block_tokens: int,
    mask_token_id: int,
    block_layout: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DraftBlock:
    """The draft block after each request's bonus token (tensor ops, no host sync).

    Args:
        bonus_tokens: [R] int64 anchor token per request. bonus_positions: [R] int P per request.
        num_block_tokens: B rows per request. mask_token_id: the drafter's MASK token.
        block_layout: (query_start_loc [R + 1] int32, row_req [R*B] int32) to use as they are
            (padded CUDA-graph layouts); None = request r owns rows r*B..(r+1)*B-1.
    """
    num_reqs, device = bonus_tokens.shape[0], bonus_tokens.device
    ids = torch.full((num_reqs, num_block_tokens), mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = bonus_tokens
    offsets = torch.arange(num_block_tokens, device=device)
    positions = bonus_positions.long()[:, None] + offsets[None, :]
    if block_layout is None:
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=device) * num_block_tokens
        row_req = torch.arange(num_reqs, dtype=torch.int32, device=device).repeat_interleave(num_block_tokens)
    else:
        qsl, row_req = block_layout
    return DraftBlock(
        num_block_tokens=num_block_tokens,
        token_ids=ids.reshape(-1),
        positions=positions.reshape(-1),
        seq_lens=bonus_positions.to(torch.int32),
        query_start_loc=qsl,
        row_req=row_req,
        slot_mapping=torch.full((num_reqs * num_block_tokens,), PADDING_SLOT, dtype=torch.int64, device=device),
    )


def widen_layout(
    query_start_loc: torch.Tensor, row_req: torch.Tensor, rows_per_req: int, num_block_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform step's layout (Q = rows_per_req rows per request, padding requests empty) with
    every request's range B = num_block_tokens rows wide -> (query_start_loc [R + 1] int32,
    row_req [R*B] int32). Device ops only, so a CUDA graph replays them."""
    if num_block_tokens == rows_per_req:
        return query_start_loc, row_req
    num_reqs = query_start_loc.shape[0] - 1
    # ranges start at multiples of Q; a request's first row names it (or -1). contiguous: for one
    # request the expanded rows reshape to a stride-0 view, which kernels indexing row_req[row]
    # read past (stale rows, an illegal address on the H200, session 24)
    widened = row_req.view(num_reqs, rows_per_req)[:, :1].expand(num_reqs, num_block_tokens).contiguous().view(-1)
    return query_start_loc // rows_per_req * num_block_tokens, widened


def check_uniform_step(
    target: torch.Tensor,
    input_ids: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_block_tokens: int,
) -> None:
    """Shape checks shared by the twin and the kernel (shapes only: no device values are read).

    Raises:
        ValueError: a tensor of the wrong shape, or B < Q.
    """
    if target.dim() != 2:
        raise ValueError(f"target must be [R, Q], got {tuple(target.shape)}")
    num_reqs, q = target.shape
    for name, t in (("input_ids", input_ids), ("row_req", row_req), ("positions", positions),
                    ("slot_mapping", slot_mapping)):  # fmt: skip
        if t.shape != (num_reqs * q,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [R*Q] = [{num_reqs * q}]")
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc has shape {tuple(query_start_loc.shape)}, expected [{num_reqs + 1}]")
    if num_block_tokens < q:
        raise ValueError(f"num_block_tokens {num_block_tokens} is less than the {q} rows verified per request")


def uniform_step_inputs(
    target: torch.Tensor,
    input_ids: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_block_tokens: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, DraftBlock]:
    """Verify a padded uniform step's drafts and lay out the next draft block (module docstring).

    Args:
        target: [R, Q] int64, the target's token at each verified row (Q = K + 1).
        input_ids: [R*Q] int64 the step's rows: per request [anchor, K drafts].
        row_req: [R*Q] int32 request index per row (-1: a padding request, all of its Q rows).
        positions: [R*Q] int64. slot_mapping: [R*Q] int64 (PADDING_SLOT for padding rows).
        query_start_loc: [R + 1] int32 (padding requests empty).
        num_block_tokens: B >= Q rows per request in the draft block. mask_token_id: MASK.
    Returns:
        (num_accepted [R] int64: leading drafts equal to the target's tokens;
         context_slot_mapping [R*Q] int64: slot_mapping with the rejected draft rows of real
             requests set to PADDING_SLOT;
         the DraftBlock after each bonus token: target[r, num_accepted[r]] at positions[r*Q] + 1 +
             num_accepted[r] for real requests, MASK at position 0 for padding ones).
        Values of padding requests other than the block's are junk. Inputs are not modified.
    Raises:
        ValueError: see `check_uniform_step`.
    """
    check_uniform_step(target, input_ids, row_req, positions, slot_mapping, query_start_loc, num_block_tokens)
    num_reqs, q = target.shape
    num_drafts = torch.full((num_reqs,), q - 1, dtype=torch.long, device=target.device)
    num_accepted = verify_drafts(target, input_ids.view(num_reqs, q)[:, 1:], num_drafts)
    index = torch.arange(num_reqs * q, dtype=torch.long, device=target.device)
    # a uniform step's logits rows are its forward rows in order
    logits_rows = torch.where(row_req.view(num_reqs, q) >= 0, index.view(num_reqs, q), -1)
    prepared = prepare_draft_inputs(logits_rows, index, num_accepted, target, positions, slot_mapping, mask_token_id)
    layout = widen_layout(query_start_loc, row_req, q, num_block_tokens)
    block = build_draft_block(prepared.bonus_tokens, prepared.bonus_positions, num_block_tokens, mask_token_id, layout)
    return num_accepted, prepared.context_slot_mapping, block


def uniform_step_preparer(backend_name: str):
    """`uniform_step_inputs_triton` (one launch) next to the Triton attention backend, else the
    torch twin `uniform_step_inputs` (same arguments and outputs)."""
    if backend_name == "triton":
        from blockdraft.spec.dflash.draft_block_triton import uniform_step_inputs_triton

        return uniform_step_inputs_triton
    return uniform_step_inputs
