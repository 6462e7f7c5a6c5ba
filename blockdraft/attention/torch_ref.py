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
    if slot_mapping.numel() == 0:
        return
    if bool(slot_mapping.min() >= 0):
        # Common case (no padding rows): skip the boolean-mask gathers, a few copies per layer.
        rows, slots = slice(None), slot_mapping
    else:
        rows = slot_mapping != PADDING_SLOT
        slots = slot_mapping[rows]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[rows].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[rows].to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first `length` tokens of one request from a paged cache -> [length, kv_heads, dim]."""
    bs = cache.shape[1]
    n_pages = (length + bs - 1) // bs
    # index_select, not advanced indexing: the latter is several times slower on CPU here.
    return cache.index_select(0, block_row[:n_pages]).view(-1, *cache.shape[2:])[:length]


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
    kv_written: bool = False,
) -> torch.Tensor:
    """Write this forward's K/V to the cache (causal forwards only), then attend.

    Args:
        q: [num_rows, num_heads, head_dim]; k, v: [num_rows, num_kv_heads, head_dim].
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim].
        meta: the batch layout; see AttentionMetadata. In draft-block mode
            (`meta.num_block_tokens > 0`) nothing is written, whatever `slot_mapping` says.
        scale: softmax scale (usually head_dim ** -0.5).
        sliding_window: attend only to the last `sliding_window` positions (incl. self), or None.
        causal: for draft blocks only: False = bidirectional inside the block.
        kv_written: True when the caller already wrote this forward's K/V into the cache (the
            q/k RoPE kernel's `kv_write`); nothing is written then.
    Returns:
        [num_rows, num_heads, head_dim] in q's dtype; rows past `query_start_loc[-1]`
        (padding) are zero.
    """
    if not kv_written and not meta.num_block_tokens:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qsl = meta.query_start_loc_host
    out[qsl[-1] :].zero_()
    for i, seq_len in enumerate(meta.seq_lens_host):
        lo, hi = qsl[i], qsl[i + 1]
        if hi == lo:
            continue
        keys = gather_kv(k_cache, meta.block_table[i], seq_len)
        vals = gather_kv(v_cache, meta.block_table[i], seq_len)
        if meta.num_block_tokens:
            keys = torch.cat([keys, k[lo:hi].to(keys.dtype)])
            vals = torch.cat([vals, v[lo:hi].to(vals.dtype)])
            block_causal = causal or sliding_window is not None
            mask = _mask(seq_len, hi - lo, keys.shape[0], sliding_window, block_causal, q.device)
        elif 1 < hi - lo <= ROW_BY_ROW_MAX_ROWS:
            _attend_row_by_row(q[lo:hi], keys, vals, seq_len, sliding_window, scale, out[lo:hi])
            continue
        else:
            mask = _mask(seq_len - (hi - lo), hi - lo, seq_len, sliding_window, True, q.device)
        _attend(q[lo:hi], keys, vals, mask, scale, out[lo:hi])
    return out


paged_attention.accepts_kv_written = True  # see AttentionBackend


# Causal query ranges of at most this many rows (DFlash verify blocks: K + 1 <= block_size rows)
# are attended one row at a time; longer ones (prefill chunks) in one call.
ROW_BY_ROW_MAX_ROWS = 32


def _attend_row_by_row(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, seq_len: int, window: int | None, scale: float,
    out: torch.Tensor,
) -> None:
    """Causal rows q [n, H, D] (the last n of `seq_len` positions), each attended exactly as a
    one-row decode step at its position would be: same key count, same mask, same call.

    Why: the matmuls' reduction order depends on their shapes (the probs @ V product splits the
    key dimension differently for 300 and 316 keys), so a row inside a verify block would differ
    from the same row decoded alone in the last bits, and a greedy near-tie could then flip:
    speculative output must equal plain decoding token for token.
    """
    n = q.shape[0]
    # _attend computes in float32: convert the keys once here, not once per row (exact, so each
    # row still sees the values a one-row step converts)
    keys, vals = keys.float(), vals.float()
    for j in range(n):
        length = seq_len - n + j + 1
        mask = _mask(length - 1, 1, length, window, True, q.device)
        _attend(q[j : j + 1], keys[:length], vals[:length], mask, scale, out[j : j + 1])


def _mask(
    q_start: int, num_q: int, num_keys: int, window: int | None, causal: bool, device=None
) -> torch.Tensor | None:
    """Boolean [num_q, num_keys] mask (True = may attend) for queries at positions
    q_start..q_start+num_q-1 over keys at positions 0..num_keys-1; None when every query may
    attend to every key (the common decode row), which lets `_attend` skip masking."""
    last_q = q_start + num_q - 1
    sees_all = (not causal or (num_q == 1 and last_q >= num_keys - 1)) and (window is None or last_q - window < 0)
    if sees_all:
        return None
    q_pos = torch.arange(q_start, q_start + num_q, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    allowed = k_pos <= q_pos if causal else torch.ones(num_q, num_keys, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


# Above this many attention scores (rows x heads x keys), use SDPA (memory-efficient) instead of the
# explicit matmul-softmax-matmul, which is ~2x faster on CPU for decode / verify / short chunks.
_MATH_MAX_SCORES = 1 << 22


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, out: torch.Tensor
) -> None:
    """q [nq, H, D], k/v [nk, KVH, D] (GQA: H % KVH == 0); mask [nq, nk] bool or None.

    Writes the attention output [nq, H, D] into `out` (a contiguous row slice, q's dtype).
    """
    if q.shape[0] * q.shape[1] * k.shape[0] > _MATH_MAX_SCORES:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.to(q.dtype).transpose(0, 1),
            v.to(q.dtype).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out.copy_(o.transpose(0, 1))
        return
    nq, heads, dim = q.shape
    nk, kv_heads, _ = k.shape
    group = heads // kv_heads
    # float32 math: more accurate than bf16 and, at these small sizes, faster on CPU (bf16 bmm
    # has a large fixed cost). Queries sharing a KV head are stacked: one bmm per KV head.
    qg = q.float().reshape(nq, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * nq, dim)
    scores = torch.baddbmm(qg.new_empty(()), qg, k.float().permute(1, 2, 0), beta=0.0, alpha=scale)
    scores = scores.view(kv_heads, group, nq, nk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kv_heads, group * nq, nk)
    o = torch.bmm(probs, v.float().transpose(0, 1))
    out.view(nq, kv_heads, group, dim).copy_(o.view(kv_heads, group, nq, dim).permute(2, 0, 1, 3))
