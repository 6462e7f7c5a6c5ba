"""Paged attention as Triton kernels: an AttentionBackend for CUDA, graph-capturable.

Semantics are exactly those of the reference `blockdraft.attention.torch_ref.paged_attention`
(its vectorised twin is `blockdraft.attention.dense_ref.paged_attention_dense`):
  causal (num_block_tokens == 0): the rows' K/V are written to the cache first (slot < 0 writes
      nothing); row t of request r sits at position p = seq_lens[r] - (query_start_loc[r+1] - t)
      and attends to cached positions max(0, p - sliding_window + 1) .. p.
  draft block (num_block_tokens = B > 0): nothing is written; row t sits at position
      seq_lens[r] + (t - query_start_loc[r]) and attends to the seq_lens[r] cached tokens and to
      the block's own rows query_start_loc[r] .. query_start_loc[r+1] - 1, read from `k`/`v`
      (not the cache); bidirectional inside the block, or causal + window when `causal` is set or
      the layer has a sliding window.
  padding rows (row_req == -1) produce zeros.

Launches: one to write K/V (causal forwards only), one to attend, and -- only for batches too
small to fill the GPU -- one to merge split-KV partials (flash-decoding). Grids depend only on
tensor shapes, the kernels read only device metadata, and nothing is read back to the host, so a
call can be captured in a CUDA graph. Two attention kernels, picked from shapes alone
(`use_multi_row`):
  single-row (`_paged_attention_kernel`, decode batches): one program per (row, kv head[, split]);
      the GROUP = num_heads / num_kv_heads query heads sharing that KV head (padded to >= 16
      rows for tl.dot) run an online softmax in float32 over key tiles gathered through the
      block table.
  multi-row (`_multi_row_attention_kernel`, verify / draft blocks / prefill chunks): one program
      per (query tile of up to ROWS rows of one request, kv head[, split]); the tile's rows x
      GROUP heads are stacked into the M dimension of one tl.dot (BLOCK_M, a power of two >= 16,
      holds ROWS = BLOCK_M // GROUP rows), so each K/V tile is read from the cache once per
      request tile instead of once per row (16 verify rows re-read the context 16 times in the
      single-row kernel). Per-(row, key) masks carry the causal / window / context / block rules.
      Long chunks span several tiles; spare and padding tiles are inert (see `_find_segment`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from blockdraft.attention.dense_ref import row_requests_device
from blockdraft.attention.metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = math.log2(math.e)  # the kernel works in exp2 units
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
MAX_KV_SPLITS = 32


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_kc_page, stride_kc_tok, stride_kc_head,
    stride_vc_page, stride_vc_tok, stride_vc_head,
    HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Grid (rows, kv_heads): copy one head of one row to its slot; slot < 0 writes nothing."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    page = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + row.to(tl.int64) * stride_k_row + head * stride_k_head + d)
    v = tl.load(v_ptr + row.to(tl.int64) * stride_v_row + head * stride_v_head + d)
    kc = k_cache_ptr + page * stride_kc_page + offset * stride_kc_tok + head * stride_kc_head + d
    vc = v_cache_ptr + page * stride_vc_page + offset * stride_vc_tok + head * stride_vc_head + d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty))
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _split_tiles(tile_lo, tile_hi, split, NUM_SPLITS: tl.constexpr):
    """Key tiles [lo, hi) of KV split `split` out of NUM_SPLITS equal shares of [tile_lo, tile_hi)."""
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.maximum(tile_hi - tile_lo, 0), NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
    return tile_lo, tile_hi


@triton.jit
def _load_cached_kv(
    k_cache_ptr, v_cache_ptr, table_row, n, mask, d, kv_head,
    stride_kc_page, stride_kc_tok, stride_kc_head, stride_vc_page, stride_vc_tok, stride_vc_head,
    KV_BLOCK_SIZE: tl.constexpr,
):
    """Cached K and V [N, D] (cache dtype) of token positions n [N] of one request, whose pages
    come from its block-table row; positions where mask is False read as 0."""
    page = tl.load(table_row + n // KV_BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    tok = n % KV_BLOCK_SIZE
    kc = k_cache_ptr + page * stride_kc_page + tok * stride_kc_tok + kv_head * stride_kc_head
    vc = v_cache_ptr + page * stride_vc_page + tok * stride_vc_tok + kv_head * stride_vc_head
    keys = tl.load(kc[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    vals = tl.load(vc[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    return keys, vals


@triton.jit
def _load_block_kv(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, src, mask, d, kv_head,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
):
    """This forward's K and V [B, D] of rows src [B] (int64), rounded through the cache dtype as
    torch_ref does (a no-op when the dtypes agree); rows where mask is False read as 0."""
    # != 0: Triton 3.9's interpreter gives `program_id == 0` an int32 type, which then spreads to
    # the mask and fails its load ("mask has unsupported dtype"); compiled, the mask is int1 already
    ok = mask != 0
    keys = tl.load(k_ptr + src[:, None] * stride_k_row + kv_head * stride_k_head + d[None, :],
                   mask=ok[:, None], other=0.0)  # fmt: skip
    vals = tl.load(v_ptr + src[:, None] * stride_v_row + kv_head * stride_v_head + d[None, :],
                   mask=ok[:, None], other=0.0)  # fmt: skip
    return keys.to(k_cache_ptr.dtype.element_ty), vals.to(v_cache_ptr.dtype.element_ty)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, keys, vals, allowed, scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running (acc, max, sum); scores are in log2 units.

    q [M, D], keys / vals [N, D], allowed [M, N] or [1, N] (broadcast over the M query rows)."""
    s = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A tile with no allowed key leaves m_new at -inf: shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, row_req_ptr,
    scale_log2, window,
    stride_o_row, stride_o_head, stride_q_row, stride_q_head,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_kc_page, stride_kc_tok, stride_kc_head,
    stride_vc_page, stride_vc_tok, stride_vc_head,
    stride_bt_req,
    part_acc_ptr, part_m_ptr, part_l_ptr, num_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid (rows, kv_heads, NUM_SPLITS): attention of one row's GROUP query heads over one KV
    head. NUM_SPLITS == 1 writes the output; otherwise split s covers the s-th share of the
    row's key tiles (split 0 also the draft block) and writes unnormalised partials
    (acc, running max, running sum) for `_combine_splits_kernel`."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    out_ptrs = out_ptr + row.to(tl.int64) * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
    part = (row.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G] partial index
    req = tl.load(row_req_ptr + row)
    if req < 0:  # padding row: zeros (an empty partial when split)
        if NUM_SPLITS == 1:
            tl.store(out_ptrs, tl.zeros([BLOCK_G, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                     tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32), mask=head_ok[:, None])  # fmt: skip
            tl.store(part_m_ptr + part, tl.full([BLOCK_G], float("-inf"), dtype=tl.float32), mask=head_ok)
            tl.store(part_l_ptr + part, tl.zeros([BLOCK_G], dtype=tl.float32), mask=head_ok)
        return

    req_start = tl.load(query_start_loc_ptr + req)
    req_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    if BLOCK_TOKENS == 0:
        q_pos = seq_len - (req_end - row)
        ctx_end = q_pos + 1  # cached keys 0 .. q_pos (this row's K/V was just written)
    else:
        q_pos = seq_len + (row - req_start)
        ctx_end = seq_len  # the whole cached context; the block follows from k/v
    ctx_start = 0
    if USE_WINDOW:
        ctx_start = tl.maximum(q_pos - window + 1, 0)

    q = tl.load(
        q_ptr + row.to(tl.int64) * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    # Cached keys, BLOCK_N tokens per tile; each token's page comes from the block table.
    tile_lo, tile_hi = _split_tiles(ctx_start // BLOCK_N, tl.cdiv(ctx_end, BLOCK_N), split, NUM_SPLITS)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        allowed = (n >= ctx_start) & (n < ctx_end)
        keys, vals = _load_cached_kv(
            k_cache_ptr, v_cache_ptr, table_row, n, allowed, d, kv_head,
            stride_kc_page, stride_kc_tok, stride_kc_head, stride_vc_page, stride_vc_tok, stride_vc_head,
            KV_BLOCK_SIZE,
        )
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, keys, vals, allowed[None, :], scale_log2, DOT_PRECISION
        )

    if BLOCK_TOKENS > 0:
        # The block's own rows (positions seq_len + j), read from this forward's k/v.
        j = tl.arange(0, BLOCK_B)
        k_pos = seq_len + j
        allowed = (j < BLOCK_TOKENS) & (j < req_end - req_start) & (split == 0)
        if CAUSAL:
            allowed = allowed & (k_pos <= q_pos)
        if USE_WINDOW:
            allowed = allowed & (k_pos > q_pos - window)
        keys, vals = _load_block_kv(
            k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, (req_start + j).to(tl.int64), allowed, d, kv_head,
            stride_k_row, stride_k_head, stride_v_row, stride_v_head,
        )
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, keys, vals, allowed[None, :], scale_log2, DOT_PRECISION
        )

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=head_ok[:, None])
        tl.store(part_m_ptr + part, m_i, mask=head_ok)
        tl.store(part_l_ptr + part, l_i, mask=head_ok)


@triton.jit
def _find_segment(query_start_loc_ptr, tile, num_reqs, ROWS: tl.constexpr):
    """Segment (request, or num_reqs = the trailing padding rows) owning query tile `tile`.

    Segment i owns tiles qsl[i] // ROWS + i .. qsl[i+1] // ROWS + i (its first tile index is
    non-decreasing in i and the count is >= cdiv(rows of i, ROWS)), so a binary search over
    query_start_loc finds it without a host-built tile map."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // ROWS + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _multi_row_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, row_req_ptr,
    scale_log2, window, num_rows, num_reqs,
    stride_o_row, stride_o_head, stride_q_row, stride_q_head,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_kc_page, stride_kc_tok, stride_kc_head,
    stride_vc_page, stride_vc_tok, stride_vc_head,
    stride_bt_req,
    part_acc_ptr, part_m_ptr, part_l_ptr, num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_ROW_REQ: tl.constexpr,
):  # fmt: skip
    """Grid (num_rows // ROWS + num_reqs + 1, kv_heads, NUM_SPLITS): attention of up to ROWS
    consecutive query rows of ONE request x the GROUP query heads of one KV head.

    The M = BLOCK_M dimension stacks (row, head) pairs, m -> (row0 + m // GROUP, m % GROUP),
    ROWS = BLOCK_M // GROUP; each gathered [BLOCK_N, HEAD_DIM] K/V tile is read once and used by
    every row through one tl.dot, with the per-(row, key) mask (causal position, context length,
    window, draft block) applied to the scores. Programs past their segment's last row exit;
    the trailing padding segment (rows qsl[-1] .. num_rows) writes zeros. NUM_SPLITS as in
    `_paged_attention_kernel` (partials per (row, head, split)).

    Tensors: out / q [T, H, D] and k / v [T, KVH, D] (q's dtype, last dim contiguous), caches
    [pages, KV_BLOCK_SIZE, KVH, D], query_start_loc [num_reqs + 1] / seq_lens [num_reqs] /
    block_table [num_reqs, W] / row_req [T] int32 (row_req read only when HAS_ROW_REQ);
    partials float32 part_acc [T, H, NUM_SPLITS, D], part_m / part_l [T, H, NUM_SPLITS]."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seg = _find_segment(query_start_loc_ptr, tile, num_reqs, ROWS)
    is_req = seg < num_reqs  # else the padding segment
    seg_start = tl.load(query_start_loc_ptr + seg)
    seg_end = tl.load(query_start_loc_ptr + seg + 1, mask=is_req, other=num_rows)
    row0 = seg_start + (tile - (seg_start // ROWS + seg)) * ROWS
    if row0 >= seg_end:  # a spare tile of this segment
        return
    seq_len = tl.load(seq_lens_ptr + seg, mask=is_req, other=0)

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    rows = row0 + m // GROUP  # [BLOCK_M] query row of each stacked (row, head)
    heads = kv_head * GROUP + m % GROUP
    in_tile = (m < ROWS * GROUP) & (rows < seg_end)  # (row, head) pairs this program writes
    real = in_tile & is_req
    if HAS_ROW_REQ:
        real = real & (tl.load(row_req_ptr + rows, mask=in_tile, other=-1) >= 0)
    rows64 = rows.to(tl.int64)

    if BLOCK_TOKENS == 0:
        q_pos = seq_len - (seg_end - rows)
        ctx_end = q_pos + 1  # cached keys 0 .. q_pos (the rows' K/V were just written)
    else:
        q_pos = seq_len + (rows - seg_start)
        ctx_end = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len  # the block follows from k/v
    ctx_start = tl.zeros([BLOCK_M], dtype=tl.int32)
    if USE_WINDOW:
        ctx_start = tl.maximum(q_pos - window + 1, 0)
    # Key range of the whole tile: the union of its real rows' ranges.
    key_lo = tl.min(tl.where(real, ctx_start, 1 << 30), axis=0)
    key_hi = tl.max(tl.where(real, ctx_end, 0), axis=0)

    q = tl.load(q_ptr + rows64[:, None] * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=in_tile[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    tile_lo, tile_hi = _split_tiles(key_lo // BLOCK_N, tl.cdiv(key_hi, BLOCK_N), split, NUM_SPLITS)
    table_row = block_table_ptr + seg.to(tl.int64) * stride_bt_req
    for key_tile in range(tile_lo, tile_hi):
        n = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        needed = (n >= key_lo) & (n < key_hi)  # some row of the tile reads key n
        keys, vals = _load_cached_kv(
            k_cache_ptr, v_cache_ptr, table_row, n, needed, d, kv_head,
            stride_kc_page, stride_kc_tok, stride_kc_head, stride_vc_page, stride_vc_tok, stride_vc_head,
            KV_BLOCK_SIZE,
        )
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        allowed = real[:, None] & (n[None, :] >= ctx_start[:, None]) & (n[None, :] < ctx_end[:, None])
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, keys, vals, allowed, scale_log2, DOT_PRECISION)

    if BLOCK_TOKENS > 0:
        # The block's own rows (positions seq_len + j), read from this forward's k/v.
        j = tl.arange(0, BLOCK_B)
        k_pos = seq_len + j
        key_ok = (j < BLOCK_TOKENS) & (j < seg_end - seg_start) & (split == 0) & is_req
        keys, vals = _load_block_kv(
            k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, (seg_start + j).to(tl.int64), key_ok, d, kv_head,
            stride_k_row, stride_k_head, stride_v_row, stride_v_head,
        )
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        allowed = real[:, None] & key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, keys, vals, allowed, scale_log2, DOT_PRECISION)

    # Rows that are not real (padding) end with acc = 0, l = 0, max = -inf: zeros / empty partials.
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + rows64[:, None] * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_tile[:, None])
    else:
        part = (rows64 * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=in_tile[:, None])
        tl.store(part_m_ptr + part, m_i, mask=in_tile)
        tl.store(part_l_ptr + part, l_i, mask=in_tile)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, stride_o_row, stride_o_head, num_heads,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Grid (rows, heads): merge the split partials of one head (log-sum-exp weights, base 2).
    A row whose partials are all empty (padding) gets zeros."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    split_ok = s < NUM_SPLITS
    part = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=split_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(weight * l, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_o_row + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty))


def write_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter rows into the paged cache in one launch; slots < 0 (PADDING_SLOT) write nothing.

    Triton twin of `blockdraft.attention.torch_ref.write_kv`.

    Args:
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim] (written in place).
        k, v: [num_rows, num_kv_heads, head_dim]; cast to the cache dtype.
        slot_mapping: contiguous [num_rows] int32/int64 flat slot (page * kv_block_size + offset).
    Raises:
        ValueError: mismatched shapes, a head_dim that is not a power of two, unsupported dtypes,
            a strided or other-device slot_mapping.
    """
    num_rows, num_kv_heads, head_dim = k.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if v.shape != k.shape or slot_mapping.shape != (num_rows,):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be "
            "[num_rows, num_kv_heads, head_dim] x2 and [num_rows]"
        )
    if slot_mapping.device != k.device or (num_rows > 1 and slot_mapping.stride(0) != 1):
        raise ValueError(f"slot_mapping must be contiguous and on {k.device} (the kernel reads slot i at offset i), "
                         f"got strides {slot_mapping.stride()} on {slot_mapping.device}")  # fmt: skip
    if num_rows == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_rows, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, KV_BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def paged_attention_triton(
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
    *,
    num_kv_splits: int | None = None,
    multi_row: bool | None = None,
    block_m: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Write this forward's K/V (causal forwards only), then attend; an AttentionBackend.

    Semantics: the module docstring; reference `blockdraft.attention.torch_ref.paged_attention`.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; last dim contiguous
            views (e.g. splits of a fused qkv output) are read in place.
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim], q's dtype.
        meta: batch layout; only device tensors are read (row_req is derived from
            query_start_loc when None, without a host sync).
        scale: softmax scale; sliding_window: window incl. self or None; causal: draft-block
            mode only (False = bidirectional inside the block).
        kv_written: True when the caller already wrote this forward's K/V into the cache (the
            q/k RoPE kernel's `kv_write`); nothing is written then.
        num_kv_splits: split each program's keys over this many programs and merge them in a
            second launch (flash-decoding), for batches too small to fill the GPU; None picks it
            from the shapes (`kv_splits_for` / `multi_row_kv_splits`), 1 = a single attention launch.
        multi_row: True = the multi-row kernel, False = the single-row one, None = pick from the
            shapes (`use_multi_row`). Benchmarks and tests force a path; callers leave it None.
        block_m: M of a multi-row program (query rows x GQA group), a power of two >= 16 and >=
            the group; None = `multi_row_block_m`. Tests force small tiles with it.
        batch_invariant: each row's output the same bits whatever the batch (a decode row, a
            verify row, a prefill row): the single-row kernel with INVARIANT_KV_SPLITS splits of
            the row's own key tiles (both fixed, so the summation order depends on the row's
            position alone); overrides multi_row and num_kv_splits. Used by batch-invariant mode
            (`blockdraft.layers.fused_ops.set_batch_invariant`).
    Returns:
        [T, num_heads, head_dim] in q's dtype; padding rows are zero.
    Raises:
        ValueError: head_dim not a power of two in [16, 256], dtypes outside float16 / bfloat16 /
            float32 or not all equal, num_heads not a multiple of num_kv_heads, shape mismatches,
            a non-positive sliding window, num_kv_splits outside [1, MAX_KV_SPLITS], a bad block_m.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if k.shape != (num_rows, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{num_rows}, num_kv_heads, {head_dim}]")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if len({q.dtype, k.dtype, v.dtype, k_cache.dtype}) != 1:
        raise ValueError(f"q, k, v and the caches must share one dtype, got q {q.dtype}, k {k.dtype}, "
                         f"v {v.dtype}, cache {k_cache.dtype}")  # fmt: skip
    if k_cache.shape[1] != meta.kv_block_size:
        raise ValueError(f"cache pages hold {k_cache.shape[1]} tokens but meta.kv_block_size is {meta.kv_block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    group = num_heads // num_kv_heads
    num_reqs = meta.seq_lens.shape[0]
    block_tokens = meta.num_block_tokens
    if block_m is not None and (block_m < _MIN_DOT or block_m & (block_m - 1) or block_m < group):
        raise ValueError(f"block_m must be a power of two >= max(16, GQA group {group}), got {block_m}")
    if batch_invariant:
        multi_row, num_kv_splits = False, INVARIANT_KV_SPLITS
    if multi_row is None:
        multi_row = use_multi_row(num_rows, num_reqs, block_tokens, group)
    rows_per_tile = 1
    if multi_row:
        block_m = block_m or multi_row_block_m(num_rows, num_reqs, group, head_dim, block_tokens, q.element_size())
        rows_per_tile = block_m // group
    if num_kv_splits is not None:
        splits = num_kv_splits
    elif multi_row:
        splits = multi_row_kv_splits(-(-num_rows // rows_per_tile), num_kv_heads, q.device)
    else:
        splits = kv_splits_for(num_rows, num_kv_heads, q.device)
    if not 1 <= splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {splits}")

    if not kv_written and not block_tokens:
        write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return out
    row_req = None if meta.row_req is None else meta.row_req.contiguous()  # kernels read row_req[row]
    if row_req is None and not multi_row:  # the multi-row kernel finds requests from query_start_loc
        row_req = row_requests_device(meta.query_start_loc, num_rows)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    block_table = _last_dim_contiguous(meta.block_table)
    if splits > 1:  # float32 partials, merged by _combine_splits_kernel
        part_acc = torch.empty(num_rows, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_rows, num_heads, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    tensors = (out, q, k, v, k_cache, v_cache, meta.query_start_loc.contiguous(), meta.seq_lens.contiguous(), block_table,
               row_req if row_req is not None else meta.query_start_loc)  # fmt: skip
    strides = (
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        part_acc, part_m, part_l, num_heads,
    )  # fmt: skip
    consts = dict(
        GROUP=group, HEAD_DIM=head_dim, KV_BLOCK_SIZE=meta.kv_block_size, BLOCK_N=_key_tile(head_dim),
        BLOCK_TOKENS=block_tokens, BLOCK_B=max(_MIN_DOT, triton.next_power_of_2(max(block_tokens, 1))),
        CAUSAL=bool(causal or sliding_window is not None), USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", NUM_SPLITS=splits,
    )  # fmt: skip
    scale_log2, window = scale * _LOG2E, sliding_window or 0
    if multi_row:
        grid = (num_rows // rows_per_tile + num_reqs + 1, num_kv_heads, splits)
        _multi_row_attention_kernel[grid](
            *tensors, scale_log2, window, num_rows, num_reqs, *strides,
            BLOCK_M=block_m, ROWS=rows_per_tile, HAS_ROW_REQ=row_req is not None,
            num_warps=4 if block_m * head_dim <= 64 * 128 else 8, **consts,
        )  # fmt: skip
    else:
        _paged_attention_kernel[(num_rows, num_kv_heads, splits)](
            *tensors, scale_log2, window, *strides,
            BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)), **consts,
        )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(num_rows, num_heads)](
            out, part_acc, part_m, part_l, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
        )  # fmt: skip
    return out


paged_attention_triton.accepts_kv_written = True  # see AttentionBackend
paged_attention_triton.accepts_batch_invariant = True  # see blockdraft.layers.attention.Attention

# KV splits of every row in batch-invariant mode: a constant, so the split boundaries (equal shares
# of the row's own key tiles) and the merge's reduction tree depend on the row alone. 16 keeps one
# decode row of a 2-KV-head model on 32 programs (the default rule gives it up to 32 splits).
INVARIANT_KV_SPLITS = 16


MULTI_ROW_MAX_GROUP = 4  # see use_multi_row
MULTI_ROW_DECODE_MAX_M = 64  # see multi_row_block_m


def use_multi_row(num_rows: int, num_reqs: int, num_block_tokens: int, group: int = 1) -> bool:
    """Multi-row programs when requests carry several rows on average (verify, draft blocks,
    prefill chunks); shapes only, so a CUDA-graph bucket always takes the same path. Decode
    batches (one row per request) keep the single-row kernel, whose programs are smaller, and so
    does a single request when the GQA group exceeds MULTI_ROW_MAX_GROUP.

    Measured (H200, bf16, CUDA-graph replays, `python -m blockdraft.bench.attention_kernels
    --variants`, docs/benchmarks/gpu-2026-12-01-s11/): Qwen2.5-0.5B (group 7, 2 KV heads), 32
    requests x 16 verify rows over 256 / 1,024 tokens: multi-row (M 64) 13 / 31 us vs single-row
    23 / 64 us; draft block 10 / 28 vs 19 / 57; one request: 7-8 us either way. Qwen3-8B (group
    4): multi-row 25 / 58 us vs 115 / 331 at 32 requests."""
    several_rows = num_block_tokens > 1 or num_rows >= 2 * max(num_reqs, 1)
    return several_rows and (group <= MULTI_ROW_MAX_GROUP or num_reqs >= 2)


def multi_row_block_m(
    num_rows: int, num_reqs: int, group: int, head_dim: int, num_block_tokens: int = 0, elem_bytes: int = 2
) -> int:
    """M of a multi-row program (query rows x GQA group stacked), a power of two >= 16.

    Sized to hold a whole typical request (the draft block, or the mean rows per request, e.g.
    16 verify rows x group 4 = 64 for Qwen3-8B), capped at 128 for head_dim x elem_bytes <= 256
    (bf16 / fp16 up to head_dim 128), else 64: the float32 [M, head_dim] accumulator plus the
    [M, BLOCK_N] scores stay in registers (M 128 x head_dim 128 runs with 8 warps, 64
    regs/thread for acc) and float32 inputs (tests) keep their shared-memory tiles small; longer
    prefill chunks are tiled over several programs. Requests of at most 16 rows (verify, draft
    blocks) cap M at MULTI_ROW_DECODE_MAX_M = 64; 32 requests x 16 verify rows over 256 / 1,024
    tokens: group 7 (16 x 7 = 112 -> 128) M 64 13 / 31 us vs M 128 21 / 32; Qwen3-8B M 64 (its
    natural size) 24 / 59 vs 38 / 99 (docs/benchmarks/gpu-2026-12-01-s11/)."""
    rows = num_block_tokens or -(-num_rows // max(num_reqs, 1))
    cap = 128 if head_dim * elem_bytes <= 256 else 64
    if rows <= 16:
        cap = min(cap, MULTI_ROW_DECODE_MAX_M)
    return max(_MIN_DOT, triton.next_power_of_2(group), min(cap, triton.next_power_of_2(rows * group)))


def multi_row_kv_splits(num_tiles: int, num_kv_heads: int, device: torch.device) -> int:
    """KV splits of the multi-row kernel from shapes alone (graph-safe): 1 unless the programs
    (query tiles x kv heads) fill less than half the streaming multiprocessors, else at most one
    program per SM. Its programs hold up to 64-128 (row, head) pairs, so splitting them as finely
    as single rows (`kv_splits_for`, two programs per SM) cost more in merges and short key loops
    than it gained (H200, docs/benchmarks/gpu-2026-12-01-s11/): Qwen2.5-0.5B, 32 requests x 16
    verify rows over 256 tokens, 1 split 13.2 us vs 2 17.3 vs 4 20.5; Qwen3-8B, 8 requests (64
    programs), 2 splits 16.8 / 32.9 us over 256 / 1,024 tokens vs 4 24.4 / 35.4. Off CUDA
    (the interpreter) 1."""
    if device.type != "cuda":
        return 1
    programs = max(num_tiles * num_kv_heads, 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if 2 * programs >= sms:
        return 1
    return min(MAX_KV_SPLITS, sms // programs)


def kv_splits_for(num_rows: int, num_kv_heads: int, device: torch.device) -> int:
    """KV splits per (row, kv head) of the single-row kernel from shapes alone (graph-safe):
    enough programs for about two per streaming multiprocessor when `num_rows` x kv_heads alone
    leave the GPU idle, else 1 (multi-row: `multi_row_kv_splits`). Off CUDA (the interpreter) 1."""
    if device.type != "cuda":
        return 1
    programs = max(num_rows * num_kv_heads, 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return min(MAX_KV_SPLITS, -(-2 * sms // programs))


def _key_tile(head_dim: int) -> int:
    """Cached keys per tile: 64 keeps a [64, head_dim] K and V tile in registers up to head_dim 256."""
    return 64 if head_dim <= 128 else 32


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Shared shape / dtype validation for both launches (see the public functions' Raises)."""
    if head_dim < _MIN_DOT or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256] for the Triton kernels, got {head_dim}")
    if k_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cache dtype must be one of {SUPPORTED_DTYPES}, got {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
                         f"{v_cache.dtype} must match")  # fmt: skip
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches must be [num_blocks, kv_block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(k_cache.shape)}")  # fmt: skip
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in head_dim (written in place, cannot be copied)")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim has stride 1 (kernels index it as base + d), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()

