"""Anchor sampling and the DFlash training attention mask.

Training runs many draft blocks of one sequence in ONE forward (DFLASH.md "Training"; paper
arXiv 2602.06036 Sec. 4; SpecForge `core/dflash.py`). Keys are laid out as
[context rows 0..T-1 ; block 0 rows ; block 1 rows ; ...], queries as [block 0 ; block 1 ; ...],
each block = B rows at positions anchor..anchor+B-1. Block a may see
  - context row j iff j < anchor_a (strictly before its anchor: features of the anchor's own
    position do not exist yet at inference), and
  - the rows of its own block (bidirectionally, or causally for causal / sliding layers),
and never another block. This reproduces the inference attention (attention/torch_ref.py,
draft-block mode) for every block at once.
"""

from __future__ import annotations

import torch


def sample_anchors(
    loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick up to `num_anchors` distinct random anchors per sequence, uniformly among its valid ones.

    A position a is a valid anchor when it is a response token (`loss_mask[a]`; at inference every
    anchor is a generated token) and the block has room for at least one label (a + 1 < length).
    Labels past the end are masked by the loss, so tail anchors still train the early slots.

    Args:
        loss_mask: [b, T] bool/int, 1 on response tokens. lengths: [b] real lengths (<= T).
        num_anchors: anchors wanted per sequence (>= 1).
        generator: CPU torch.Generator for reproducible picks (None: global RNG).
    Returns:
        anchors [b, A] int64 sorted ascending, valid [b, A] bool; A = min(num_anchors, most valid
        anchors in any row) (>= 1); invalid slots hold anchor 0.
    Raises:
        ValueError: num_anchors < 1.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    b, t = loss_mask.shape
    pos = torch.arange(t, device=loss_mask.device)
    ok = loss_mask.bool() & (pos[None, :] + 1 < lengths.to(loss_mask.device)[:, None])
    counts = ok.sum(dim=1)
    a = max(1, min(num_anchors, int(counts.max()) if b else 1))
    # Draw over the longest sequence only, so padding the batch wider does not change the anchors.
    longest = int(lengths.max()) if b else 0
    keys = torch.full((b, t), 2.0)
    keys[:, :longest] = torch.rand(b, longest, generator=generator)
    keys = keys.to(loss_mask.device)
    keys = torch.where(ok, keys, torch.full_like(keys, 2.0))  # invalid positions sort last
    picked = keys.argsort(dim=1)[:, :a]  # [b, A] random valid positions first
    valid = torch.arange(a, device=loss_mask.device)[None, :] < counts[:, None]
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    # Sort each row's valid anchors ascending (invalid ones pushed to the end, kept at 0).
    order = torch.where(valid, anchors, torch.full_like(anchors, t + 1)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [b, A] -> positions [b, A*B] = anchor + 0..B-1 per block (RoPE positions)."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).reshape(anchors.shape[0], -1)


def block_attention_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    causal: bool = False,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean training mask (True = may attend): [b, A*B, T + A*B] over [context ; blocks].

    Args:
        anchors, valid: [b, A] from `sample_anchors`. seq_len: T context rows per sequence.
        block_size: B. causal: causal inside each block (sliding / causal draft layers).
        sliding_window: keys must also satisfy key_pos > query_pos - window (incl. self).
    Invalid blocks see only their own block (never context): their loss weight is zero, and a
    row with no visible key would make SDPA return NaN.
    """
    b, a = anchors.shape
    dev = anchors.device
    q_pos = block_positions(anchors, block_size)  # [b, Q]
    q_block = torch.arange(a * block_size, device=dev) // block_size  # [Q]
    q_slot = torch.arange(a * block_size, device=dev) % block_size
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    q_valid = valid.repeat_interleave(block_size, dim=1)
    ctx_pos = torch.arange(seq_len, device=dev)
    ctx = (ctx_pos[None, None, :] < q_anchor[:, :, None]) & q_valid[:, :, None]  # [b, Q, T]
    own = q_block[:, None] == q_block[None, :]  # [Q, Q] same block
    if causal or sliding_window is not None:
        own = own & (q_slot[None, :] <= q_slot[:, None])
    blk = own[None].expand(b, -1, -1)
    if sliding_window is not None:
        ctx = ctx & (ctx_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
        blk = blk & (q_pos[:, None, :] > q_pos[:, :, None] - sliding_window)
    return torch.cat([ctx, blk], dim=2)
