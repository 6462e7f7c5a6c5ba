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

Launches: one to write K/V (causal forwards only), one to attend. Grids depend only on tensor
shapes, the kernels read only device metadata, and nothing is read back to the host, so a call
can be captured in a CUDA graph. One attention program handles one (row, kv head) pair: the
GROUP = num_heads / num_kv_heads query heads sharing that KV head (padded to >= 16 rows for
tl.dot) run an online softmax in float32 over key tiles gathered through the block table.
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
def _online_softmax_step(acc, m_i, l_i, q, keys, vals, allowed, scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running (acc, max, sum); scores are in log2 units."""
    s = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(allowed[None, :], s, float("-inf"))
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
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (rows, kv_heads): attention of one row's GROUP query heads over one KV head."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    out_ptrs = out_ptr + row.to(tl.int64) * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
    req = tl.load(row_req_ptr + row)
    if req < 0:  # padding row
        tl.store(out_ptrs, tl.zeros([BLOCK_G, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=head_ok[:, None])
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
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for tile_start in range((ctx_start // BLOCK_N) * BLOCK_N, ctx_end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        allowed = (n >= ctx_start) & (n < ctx_end)
        page = tl.load(table_row + n // KV_BLOCK_SIZE, mask=allowed, other=0).to(tl.int64)
        tok = n % KV_BLOCK_SIZE
        kc = k_cache_ptr + page * stride_kc_page + tok * stride_kc_tok + kv_head * stride_kc_head
        vc = v_cache_ptr + page * stride_vc_page + tok * stride_vc_tok + kv_head * stride_vc_head
        keys = tl.load(kc[:, None] + d[None, :], mask=allowed[:, None], other=0.0).to(q.dtype)
        vals = tl.load(vc[:, None] + d[None, :], mask=allowed[:, None], other=0.0).to(q.dtype)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, keys, vals, allowed, scale_log2, DOT_PRECISION)

    if BLOCK_TOKENS > 0:
        # The block's own rows (positions seq_len + j), read from this forward's k/v.
        j = tl.arange(0, BLOCK_B)
        k_pos = seq_len + j
        allowed = (j < BLOCK_TOKENS) & (j < req_end - req_start)
        if CAUSAL:
            allowed = allowed & (k_pos <= q_pos)
        if USE_WINDOW:
            allowed = allowed & (k_pos > q_pos - window)
        src = (req_start + j).to(tl.int64)
        keys = tl.load(k_ptr + src[:, None] * stride_k_row + kv_head * stride_k_head + d[None, :],
                       mask=allowed[:, None], other=0.0)  # fmt: skip
        vals = tl.load(v_ptr + src[:, None] * stride_v_row + kv_head * stride_v_head + d[None, :],
                       mask=allowed[:, None], other=0.0)  # fmt: skip
        # Round through the cache dtype as torch_ref does (a no-op when the dtypes agree).
        keys = keys.to(k_cache_ptr.dtype.element_ty).to(q.dtype)
        vals = vals.to(v_cache_ptr.dtype.element_ty).to(q.dtype)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, keys, vals, allowed, scale_log2, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def write_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter rows into the paged cache in one launch; slots < 0 (PADDING_SLOT) write nothing.

    Triton twin of `blockdraft.attention.torch_ref.write_kv`.

    Args:
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim] (written in place).
        k, v: [num_rows, num_kv_heads, head_dim]; cast to the cache dtype.
        slot_mapping: [num_rows] int32/int64 flat slot (page * kv_block_size + offset).
    Raises:
        ValueError: mismatched shapes, a head_dim that is not a power of two, unsupported dtypes.
    """
    num_rows, num_kv_heads, head_dim = k.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if v.shape != k.shape or slot_mapping.shape != (num_rows,):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be "
            "[num_rows, num_kv_heads, head_dim] x2 and [num_rows]"
        )
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
    Returns:
        [T, num_heads, head_dim] in q's dtype; padding rows are zero.
    Raises:
        ValueError: head_dim not a power of two in [16, 256], dtypes outside float16 / bfloat16 /
            float32 or not all equal, num_heads not a multiple of num_kv_heads, shape mismatches,
            a non-positive sliding window.
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

    block_tokens = meta.num_block_tokens
    if not block_tokens:
        write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return out
    row_req = meta.row_req if meta.row_req is not None else row_requests_device(meta.query_start_loc, num_rows)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    block_table = _last_dim_contiguous(meta.block_table)
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(num_rows, num_kv_heads)](
        out, q, k, v, k_cache, v_cache,
        meta.query_start_loc, meta.seq_lens, block_table, row_req,
        scale * _LOG2E, sliding_window or 0,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=meta.kv_block_size, BLOCK_N=_key_tile(head_dim),
        BLOCK_TOKENS=block_tokens, BLOCK_B=max(_MIN_DOT, triton.next_power_of_2(max(block_tokens, 1))),
        CAUSAL=bool(causal or sliding_window is not None), USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


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

