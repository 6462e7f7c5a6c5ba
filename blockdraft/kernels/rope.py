"""Per-head RMSNorm (optional, Qwen3 q_norm / k_norm) + rotate-half RoPE for q and k in one launch.

One program per (row, q or k): all of a row's q heads (or k heads) as one 2-D tile, so a verify
batch of 512 rows is 1,024 programs, not 8,192 one-head ones (H200, Qwen2.5-0.5B shape: 5.4 ->
1.9 us per launch). q and k may be strided views of a fused qkv projection (any row and head
stride, unit stride inside a head). Results go to new contiguous tensors, so attention backends
see the same layout as with the torch path.

With `kv_write` the k programs also store the rotated keys and the row's values at the row's
paged-cache slot, so a causal layer needs no separate cache-write launch (TensorRT-LLM's
applyBiasRopeUpdateKVCache fuses the same steps).

Rounding follows the torch twin (`blockdraft.layers.fused_ops.qk_norm_rope_ref`, i.e.
`RMSNorm` then `apply_rotary` in the input dtype): every product and the final sum are rounded
to the input dtype, like the separate torch elementwise ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(src, head_stride, num_heads, dst, w_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr,
                     HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """All `num_heads` heads of one row as one [BLOCK_H, BLOCK_HALF] tile pair (first / second half)."""
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < half)
    src = src + h * head_stride + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        sq = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)  # [BLOCK_H]
        rstd = tl.math.rsqrt(sq / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        f1 = ((f1 * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        f2 = ((f2 * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    c1 = tl.load(cos + d, mask=d < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos + half + d, mask=d < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin + d, mask=d < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin + half + d, mask=d < half, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; round like separate torch ops.
    o1 = (f1 * c1).to(x1.dtype).to(tl.float32) - (f2 * s1).to(x1.dtype).to(tl.float32)
    o2 = (f2 * c2).to(x1.dtype).to(tl.float32) + (f1 * s2).to(x1.dtype).to(tl.float32)
    dst = dst + h * HEAD_DIM + d
    tl.store(dst, o1.to(x1.dtype), mask=mask)
    tl.store(dst + half, o2.to(x1.dtype), mask=mask)
    return o1.to(x1.dtype), o2.to(x1.dtype)


@triton.jit
def _write_kv_row(k1, k2, v_src, v_head_stride, num_heads, slot_ptr, row, kc, vc, kc_page, kc_tok, kc_head,
                  vc_page, vc_tok, vc_head, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Store one row's rotated k halves (k1, k2: [BLOCK_H, BLOCK_HALF]) and its v heads at the
    row's cache slot, as `_write_kv_kernel` does (cast to the cache dtype); slot < 0 writes nothing."""
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        half: tl.constexpr = HEAD_DIM // 2
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < num_heads) & (d < half)
        page, offset = slot // KV_BLOCK_SIZE, slot % KV_BLOCK_SIZE
        k_dst = kc + page * kc_page + offset * kc_tok + h * kc_head + d
        tl.store(k_dst, k1.to(kc.dtype.element_ty), mask=mask)
        tl.store(k_dst + half, k2.to(kc.dtype.element_ty), mask=mask)
        v_at = v_src + h * v_head_stride + d
        v_dst = vc + page * vc_page + offset * vc_tok + h * vc_head + d
        tl.store(v_dst, tl.load(v_at, mask=mask, other=0.0).to(vc.dtype.element_ty), mask=mask)
        tl.store(v_dst + half, tl.load(v_at + half, mask=mask, other=0.0).to(vc.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, q_row_stride, q_head_stride,
    k_ptr, k_row_stride, k_head_stride,
    q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr,
    cos_ptr, cos_row_stride, sin_ptr, sin_row_stride,
    num_q_heads, num_k_heads, eps,
    v_ptr, v_row_stride, v_head_stride, kc_ptr, vc_ptr, slot_ptr,
    kc_page, kc_tok, kc_head, vc_page, vc_tok, vc_head,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, WRITE_KV: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Grid (rows, 2): program (row, 0) the row's q heads, (row, 1) its k heads; with WRITE_KV the
    k program also stores the rotated k and the row's v at the row's cache slot."""
    row = tl.program_id(0).to(tl.int64)
    cos = cos_ptr + row * cos_row_stride
    sin = sin_ptr + row * sin_row_stride
    if tl.program_id(1) == 0:
        if num_q_heads > 0:
            _norm_rope_heads(q_ptr + row * q_row_stride, q_head_stride, num_q_heads,
                             q_out_ptr + row * num_q_heads * HEAD_DIM, q_w_ptr, cos, sin, eps,
                             HEAD_DIM, HAS_NORM, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    else:
        k1, k2 = _norm_rope_heads(k_ptr + row * k_row_stride, k_head_stride, num_k_heads,
                                  k_out_ptr + row * num_k_heads * HEAD_DIM, k_w_ptr, cos, sin, eps,
                                  HEAD_DIM, HAS_NORM, BLOCK_HK, BLOCK_HALF)  # fmt: skip
        if WRITE_KV:
            _write_kv_row(k1, k2, v_ptr + row * v_row_stride, v_head_stride, num_k_heads, slot_ptr, row,
                          kc_ptr, vc_ptr, kc_page, kc_tok, kc_head, vc_page, vc_tok, vc_head,
                          HEAD_DIM, KV_BLOCK_SIZE, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def _check_heads(x: torch.Tensor, name: str, rows: int, head_dim: int, dtype: torch.dtype) -> None:
    if x.dim() != 3 or x.shape[0] != rows or x.shape[2] != head_dim:
        raise ValueError(f"{name} must be [rows={rows}, heads, head_dim={head_dim}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {dtype} (all inputs must share one dtype)")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride inside a head, got strides {x.stride()}")


def _cos_sin_rows(t: torch.Tensor, name: str, rows: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, D] or [rows, D] -> [rows, D] view with unit column stride."""
    if t.dim() == 3 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 2 or tuple(t.shape) != (rows, head_dim):
        raise ValueError(
            f"{name} must be [rows={rows}, 1, head_dim={head_dim}] or [rows, head_dim], got {tuple(t.shape)}"
        )
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} (all inputs must share one dtype)")
    return t if t.stride(1) == 1 else t.contiguous()


def _check_weight(w: torch.Tensor, name: str, head_dim: int, dtype: torch.dtype) -> None:
    if w.shape != (head_dim,) or w.dtype != dtype or not w.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous [{head_dim}] {dtype} tensor, got {tuple(w.shape)} {w.dtype}"
            f"{'' if w.is_contiguous() else ' (non-contiguous)'}"
        )


def _check_kv_write(v, k_cache, v_cache, slot_mapping, k) -> None:
    """The cache write's inputs against k [rows, kv_heads, head_dim] (see `qk_norm_rope`)."""
    rows, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(2) != 1 or v.device != k.device:
        raise ValueError(f"v must match k ({tuple(k.shape)}, {k.dtype}, {k.device}) with unit stride inside a "
                         f"head, got {tuple(v.shape)}, {v.dtype}, {v.device}, strides {v.stride()}")  # fmt: skip
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim) or cache.stride(3) != 1
                or cache.device != k.device or not cache.is_floating_point()):  # fmt: skip
            raise ValueError(f"{name} must be a float [num_blocks, kv_block_size, {num_kv_heads}, {head_dim}] "
                             f"tensor on {k.device} with unit stride inside a head, got {tuple(cache.shape)} "
                             f"{cache.dtype} on {cache.device}, strides {cache.stride()}")  # fmt: skip
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match")
    if (slot_mapping.shape != (rows,) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or slot_mapping.device != k.device or (rows > 1 and slot_mapping.stride(0) != 1)):  # fmt: skip
        raise ValueError(f"slot_mapping must be a contiguous int32 / int64 [{rows}] on {k.device}, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype} on {slot_mapping.device}, "
                         f"strides {slot_mapping.stride()}")  # fmt: skip


def _launch(
    q: torch.Tensor | None,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    if k.dim() != 3:
        raise ValueError(f"k must be [rows, heads, head_dim], got {tuple(k.shape)}")
    rows, num_k_heads, head_dim = k.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    dtype = k.dtype
    _check_heads(k, "k", rows, head_dim, dtype)
    if q is not None:
        _check_heads(q, "q", rows, head_dim, dtype)
    for w, name in ((q_weight, "q_weight"), (k_weight, "k_weight")):
        if w is not None:
            _check_weight(w, name, head_dim, dtype)
    cos = _cos_sin_rows(cos, "cos", rows, head_dim, dtype)
    sin = _cos_sin_rows(sin, "sin", rows, head_dim, dtype)
    num_q_heads = 0 if q is None else q.shape[1]
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        _check_kv_write(v, k_cache, v_cache, slot_mapping, k)
    else:  # placeholders, never read without WRITE_KV
        v, k_cache, v_cache, slot_mapping = k, k, k, k
    k_out = torch.empty((rows, num_k_heads, head_dim), dtype=dtype, device=k.device)
    q_out = None if q is None else torch.empty((rows, num_q_heads, head_dim), dtype=dtype, device=k.device)
    if rows and num_q_heads + num_k_heads:
        q_arg = k if q is None else q  # a placeholder, never read: program (row, 0) skips when there are no q heads
        block_hq, block_hk = triton.next_power_of_2(max(num_q_heads, 1)), triton.next_power_of_2(max(num_k_heads, 1))
        _qk_norm_rope_kernel[(rows, 2)](
            q_arg, q_arg.stride(0), q_arg.stride(1), k, k.stride(0), k.stride(1),
            k_out if q_out is None else q_out, k_out,
            k_weight if q_weight is None else q_weight, cos if k_weight is None else k_weight,
            cos, cos.stride(0), sin, sin.stride(0),
            num_q_heads, num_k_heads, eps,
            v, v.stride(0), v.stride(1), k_cache, v_cache, slot_mapping,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HEAD_DIM=head_dim, HAS_NORM=k_weight is not None, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2), WRITE_KV=kv_write is not None,
            KV_BLOCK_SIZE=k_cache.shape[1] if kv_write is not None else 1,
            num_warps=max(1, min(8, block_hq * triton.next_power_of_2(head_dim // 2) // 256)),
            # No FMA contraction: x * cos must be rounded before the add, as in torch's separate ops.
            enable_fp_fusion=False,
        )  # fmt: skip
    return q_out, k_out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm, then RoPE, of q and k in one launch; with `kv_write`, the
    same launch also writes the rotated k and v into the paged KV cache (what the attention
    backend's `write_kv` would do next, one launch less per layer).

    Args:
        q: [rows, num_heads, head_dim]; k: [rows, num_kv_heads, head_dim]; any row / head
            strides (e.g. views of a fused qkv output), unit stride inside a head.
        cos, sin: [rows, 1, head_dim] or [rows, head_dim] (`RotaryEmbedding.cos_sin`).
        q_weight, k_weight: [head_dim] RMSNorm weights (Qwen3 q_norm / k_norm), both or neither.
        eps: RMSNorm epsilon (unused without weights).
        kv_write: None, or (v [rows, num_kv_heads, head_dim] like k, k_cache, v_cache
            [num_blocks, kv_block_size, num_kv_heads, head_dim] (written in place, each cast to
            its own float dtype; any page / token / head strides), slot_mapping a contiguous
            [rows] int32 / int64 flat slot page * kv_block_size + offset (< 0 writes nothing),
            all on k's device): the cache holds exactly what `write_kv_triton(k_cache, v_cache,
            k_out, v, slot_mapping)` would write.
    Returns:
        (q_out [rows, num_heads, head_dim], k_out [rows, num_kv_heads, head_dim]), new
        contiguous tensors in the inputs' dtype.
    Raises:
        ValueError: mismatched shapes or dtypes (all inputs must share one dtype), an odd
            head_dim, a strided head, only one of the two weights, or kv_write tensors outside
            the above.
    """
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be given together (per-head q/k RMSNorm) or both be None")
    return _launch(q, k, cos, sin, q_weight, k_weight, eps, kv_write)


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`qk_norm_rope` for a single tensor (e.g. the DFlash drafter's context keys).

    x [rows, heads, head_dim] (strided rows / heads allowed) -> new contiguous
    [rows, heads, head_dim]; weight [head_dim] or None. kv_write (v, k_cache, v_cache,
    slot_mapping): also store the result and v in the paged cache, as `qk_norm_rope`'s. Raises
    ValueError like `qk_norm_rope`.
    """
    return _launch(None, x, cos, sin, None, weight, eps, kv_write)[1]
