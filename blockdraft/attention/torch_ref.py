"""Reference paged attention in plain torch: the CPU path and the test oracle for GPU kernels.

Semantics (causal): query row j of request i sits at position `seq_len - q_len + j` and attends to
cached positions `<= its own position` (and `> position - sliding_window` when a window is set).
Semantics (draft block, `num_block_tokens > 0`): every block row attends to the `seq_len` cached
context tokens and to all rows of its own block (bidirectional), or causally within the block and
inside the window for sliding layers (DFLASH.md, "Query block").
"""

from __future__ import annotations

import torch

from blockdraft.attention.metadata import PADDING_SLOT, AttentionMetadata


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter rows into the paged cache, skipping PADDING_SLOT rows.

    Args:
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim].
        k, v: [num_rows, num_kv_heads, head_dim].
        slot_mapping: [num_rows] int64.
    """
    keep = slot_mapping != PADDING_SLOT
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first `length` tokens of one request from a paged cache -> [length, kv_heads, dim]."""
    bs = cache.shape[1]
    n_pages = (length + bs - 1) // bs
    return cache[block_row[:n_pages].long()].reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Write this forward's K/V to the cache, then attend.

    Args:
        q: [num_rows, num_heads, head_dim]; k, v: [num_rows, num_kv_heads, head_dim].
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim].
        meta: the batch layout; see AttentionMetadata.
        scale: softmax scale (usually head_dim ** -0.5).
        sliding_window: attend only to the last `sliding_window` positions (incl. self), or None.
        causal: for draft blocks only: False = bidirectional inside the block.
    Returns:
        [num_rows, num_heads, head_dim] in q's dtype.
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    qsl = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        lo, hi = qsl[i], qsl[i + 1]
        if hi == lo:
            continue
        keys = gather_kv(k_cache, meta.block_table[i], seq_len)
        vals = gather_kv(v_cache, meta.block_table[i], seq_len)
        if meta.num_block_tokens:
            keys = torch.cat([keys, k[lo:hi].to(keys.dtype)])
            vals = torch.cat([vals, v[lo:hi].to(vals.dtype)])
            q_pos = torch.arange(seq_len, seq_len + hi - lo)
            block_causal = causal or sliding_window is not None
            mask = _mask(q_pos, keys.shape[0], sliding_window, block_causal, seq_len)
        else:
            q_pos = torch.arange(seq_len - (hi - lo), seq_len)
            mask = _mask(q_pos, seq_len, sliding_window, True, seq_len)
        out[lo:hi] = _sdpa(q[lo:hi], keys, vals, mask, scale)
    return out


def _mask(q_pos: torch.Tensor, num_keys: int, window: int | None, causal: bool, num_ctx: int) -> torch.Tensor:
    """Boolean [q, keys] mask: True = may attend. Keys are positions 0..num_keys-1."""
    k_pos = torch.arange(num_keys)
    allowed = torch.ones(len(q_pos), num_keys, dtype=torch.bool)
    if causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [nq, H, D], k/v [nk, KVH, D] with GQA; mask [nq, nk] bool -> [nq, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)
