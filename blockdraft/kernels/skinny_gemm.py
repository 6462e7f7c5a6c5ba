"""y = x @ W.T (+ bias) for skinny x (1-16 rows) as Triton kernels: decode and verify steps.

At batch 1 a decode step multiplies one row by every weight matrix, and a DFlash verify step /
draft block 16 rows: pure weight streaming, where cuBLAS's kernels for these shapes stop short
of the HBM bandwidth (H200, CUDA-graph replays over rotating weights larger than L2, bf16:
Qwen2.5-0.5B's q/k/v projection [896 -> 1152] 3.97 us for one row vs 2.33 us here, its o
projection 4.85 vs 2.49, Qwen3-8B's down projection [12,288 -> 4,096] 28.9 vs 25.3;
docs/benchmarks/gpu-2026-12-01-s14/skinny_gemm.json). Three kernels:

  row kernel (`_gemv_kernel`, one row): program (column block, row) streams a [BLOCK_N, K] slice
      of W in [BLOCK_N, BLOCK_K] tiles, multiplies by the row on the CUDA cores and sums in
      float32; small BLOCK_N gives enough programs to keep every SM's loads in flight.
  dot kernel (`_skinny_dot_kernel`, 1-16 rows): program (column block) multiplies the rows,
      zero-padded to 16, by [BLOCK_N, BLOCK_K] tiles of W with tl.dot, so W is read once for
      all rows; optionally split over K (split_k programs per column block, for narrow outputs
      such as a down projection to 896 features, where 28 column blocks leave most SMs idle).
      `python -m blockdraft.bench.skinny_gemm --sweep` times split-K tiles beside the others;
      the 16-row table uses them for narrow outputs (e.g. Qwen2.5-0.5B's down projection).
  Either kernel can form its input as silu(gate) * up (`up=`): a SwiGLU down projection in one
  launch (used for one row of the shapes where that measured faster, `fuses_swiglu`).
  gate/up kernel (`_skinny_swiglu_kernel`, 2-16 rows): the dot kernel over a stacked gate_up
      weight [2I, K] whose program multiplies by matching column blocks of the gate and the up
      halves and stores silu(gate) * up [rows, I] (`skinny_swiglu`): a SwiGLU's gate/up projection
      and activation in one launch, for the verify and draft-block rows (`swiglu_config_for`).

Which shapes take a kernel, and with which tiles, is measured, not guessed (`config_for`): a
table of the H200's best tiles per (K, N) for one row and for 16 rows; other one-row shapes up
to the sizes the rule was checked at use a rule fitted to those measurements; everything else
(more than 16 rows, 2-16 rows of unlisted shapes, other GPUs, float32, shapes where cuBLAS
measured as fast, shapes beyond the rule's checked sizes such as vocabulary-sized LM heads)
stays on cuBLAS via `F.linear`. BLOCKDRAFT_SKINNY_GEMM=0 in the environment before start-up keeps
every shape on cuBLAS (for side-by-side benchmarks).

Numerics: float32 accumulation, bias added in float32, one rounding to the output dtype. The
summation order differs from cuBLAS's, so results agree within bf16 rounding, not bit for bit;
each row's result depends only on its own input row (padding rows are masked out).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockdraft.kernels.linear_args import check_linear_args

MAX_ROWS = 16  # the dot kernel's M tile; more rows go to cuBLAS
# BLOCKDRAFT_SKINNY_GEMM=0 before start-up keeps every shape on cuBLAS (side-by-side benchmarks)
ENABLED = os.environ.get("BLOCKDRAFT_SKINNY_GEMM", "1") != "0"


class SkinnyConfig(NamedTuple):
    """Tiles of one launch: kernel "row" or "dot"; block_n output features and block_k input
    features per tile (powers of two; the dot kernel needs >= 16); num_warps and num_stages
    (software-pipelining depth) as in Triton; split_k (dot kernel, a power of two): programs
    sharing one column block's K, their float32 partials added by the last to finish."""

    kernel: str
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


# H200 (sm90, 132 SMs), bf16. Tiles: the fastest (or within 0.06 us of it) of 144 tilings per
# one-row shape and 48 per 16-row shape, found by the first version of `python -m blockdraft.bench.skinny_gemm --sweep` (same kernels and timing;
# docs/benchmarks/gpu-2026-12-01-s14/skinny_gemm_sweep_prototype.json); us per call cuBLAS ->
# these tiles from the bench run without the sweep (skinny_gemm.json). Keys
# (K = in_features, N = out_features); None = cuBLAS measured as fast or faster.
_SM90_ONE_ROW: dict[tuple[int, int], SkinnyConfig | None] = {
    (896, 1152): SkinnyConfig("row", 4, 1024, 8, 3),  # Qwen2.5-0.5B qkv: 3.97 -> 2.33 us
    (896, 896): SkinnyConfig("row", 4, 1024, 8, 3),  # o: 4.85 -> 2.49
    (896, 9728): SkinnyConfig("row", 16, 256, 4, 3),  # gate_up: 7.19 -> 6.62
    (4864, 896): SkinnyConfig("row", 4, 1024, 8, 3),  # down: 7.17 -> 5.39
    (896, 32768): None,  # a 32K draft head: the rule's tiles 18.03 vs cuBLAS 16.42
    (4096, 6144): SkinnyConfig("row", 8, 512, 4, 3),  # Qwen3-8B qkv: 16.23 -> 14.53
    (4096, 4096): SkinnyConfig("row", 16, 1024, 8, 3),  # o: 12.65 -> 10.51
    (4096, 24576): SkinnyConfig("row", 16, 256, 4, 4),  # gate_up: 48.36 -> 47.80
    (12288, 4096): SkinnyConfig("row", 16, 1024, 8, 3),  # down: 28.86 -> 25.34
    (4096, 32768): SkinnyConfig("dot", 64, 128, 4, 3),  # a 32K draft head: 63.35 -> 62.64
}
_SM90_SIXTEEN_ROWS: dict[tuple[int, int], SkinnyConfig] = {
    (896, 1152): SkinnyConfig("dot", 32, 128, 4, 5),  # 3.99 -> 3.90 us
    (896, 896): SkinnyConfig("dot", 32, 128, 4, 5),  # 4.33 -> 3.86
    (896, 9728): SkinnyConfig("dot", 32, 128, 4, 4),  # 7.27 -> 7.08
    (4096, 6144): SkinnyConfig("dot", 64, 256, 4, 4),  # 16.06 -> 15.53
    (4096, 4096): SkinnyConfig("dot", 32, 256, 4, 5),  # 12.59 -> 11.22
    (4096, 24576): SkinnyConfig("dot", 64, 128, 4, 3),  # 49.27 -> 48.24
    (12288, 4096): SkinnyConfig("dot", 32, 256, 4, 5),  # 28.00 -> 26.90
    (4096, 32768): SkinnyConfig("dot", 128, 128, 4, 3),  # 64.87 -> 63.30
    # session 15 sweep (split-K measured; docs/benchmarks/gpu-2026-12-01-s15/sweep16_draft.json)
    (4864, 896): SkinnyConfig("dot", 32, 256, 4, 4, 4),  # Qwen2.5-0.5B down: 7.42 -> 6.72
    (896, 128): SkinnyConfig("dot", 16, 64, 4, 4, 8),  # its drafter's k/v: 3.95 -> 3.52
    (896, 1024): SkinnyConfig("dot", 16, 128, 4, 5),  # drafter gate / up: 4.24 -> 3.80
    (1024, 896): SkinnyConfig("dot", 16, 256, 4, 4),  # drafter down: 4.44 -> 3.81
    (2688, 896): SkinnyConfig("dot", 32, 128, 4, 4, 4),  # drafter fc (3 target layers): 6.55 -> 5.48
    (4096, 1024): SkinnyConfig("dot", 32, 128, 4, 4, 4),  # Qwen3-8B drafter k/v: 7.14 -> 6.34
    (4096, 12288): SkinnyConfig("dot", 128, 128, 4, 4),  # its gate / up: 28.62 -> 27.14
    # stacked drafter projections (DFlashDraftModel.stack_projections), session 26 (a 10-tiling sweep
    # found nothing faster by more than 0.06 us): Qwen2.5-0.5B drafter gate_up 4.58 -> 4.26, its
    # context k/v 4.16 -> 3.69; the Qwen3-8B drafter's context k/v 8.80 -> 7.58-8.01
    (896, 2048): SkinnyConfig("dot", 32, 128, 4, 5),
    (896, 256): SkinnyConfig("dot", 16, 64, 4, 4, 8),
    (4096, 2048): SkinnyConfig("dot", 32, 128, 4, 4, 4),
}
# SwiGLU down projections that read gate and up themselves (`skinny_linear(..., up=...)`): one
# row of these (K, N), where one launch measured faster than the activation kernel + the GEMM
# (us per call, session 15, docs/benchmarks/gpu-2026-12-01-s15/swiglu.json): Qwen3-8B down 27.96
# -> 27.55, SmolLM2-135M down 4.60 -> 3.44. Not taken: Qwen2.5-0.5B 6.35 -> 6.43 and 1.5B 11.46
# -> 11.49 (even); 16 rows (Qwen3-8B 30.47 -> 214 us: every program recomputes silu for 16 rows
# of K and the GEMM turns compute-bound).
_SM90_SWIGLU_ONE_ROW = frozenset({(12288, 4096), (1536, 576)})


def fuses_swiglu(rows: int, in_features: int, out_features: int) -> bool:
    """True when a SwiGLU down projection of `rows` rows and this weight shape ([out, in]) should
    form silu(gate) * up inside its skinny-GEMM launch (one row of a measured-faster shape; the
    kernel must also be chosen by `config_for`). Pure lookup, no errors."""
    return rows == 1 and (in_features, out_features) in _SM90_SWIGLU_ONE_ROW


# Stacked gate_up weights [2I, K] whose 2-16-row SwiGLU runs as one `skinny_swiglu` launch, and its
# tiles (block_n = columns of each half per program). Keys (K, 2I). us per call at 16 rows, the
# gate_up GEMM + activation kernel -> one launch (session 26, `python -m blockdraft.bench.skinny_gemm
# --rows 16 --linears gate_up draft_gate_up`, docs/benchmarks/gpu-2026-12-03-s26/). Unlisted shapes
# whose 16-row gate_up GEMM has dot tiles without split-K take those tiles with half the block width
# (the same weight rows per program); see `swiglu_config_for`.
_SM90_SWIGLU_GATE_UP: dict[tuple[int, int], SkinnyConfig | None] = {
    (4096, 24576): SkinnyConfig("dot", 32, 128, 4, 3),  # Qwen3-8B (and its drafter): 49.62 -> 48.62
    (896, 9728): SkinnyConfig("dot", 64, 128, 4, 4),  # Qwen2.5-0.5B: 8.82 -> 7.21 (block_n 16: 9.32, 32: 7.65)
    (896, 2048): SkinnyConfig("dot", 32, 128, 4, 5),  # its drafter (MLP 1,024): 5.75 -> 5.11 (16: 5.26)
}


def swiglu_config_for(rows: int, in_features: int, stacked_out: int, device: torch.device) -> SkinnyConfig | None:
    """Tiles for `skinny_swiglu` of x [rows, in_features] with a gate_up weight [stacked_out, in_features].

    Returns None (two launches: the gate_up GEMM as `config_for` picks it, then the activation
    kernel) for one row (the one-row path fuses the activation into the down projection instead,
    `fuses_swiglu`), more than MAX_ROWS rows, an odd stacked_out, a (K, 2I) listed as None in the
    table, or an unlisted one whose 16-row gate_up GEMM has no dot tiles without split-K; else the
    table's tiles or those GEMM tiles with block_n halved (at least 16). Off sm90 / switched off:
    None, as `config_for`. Pure lookup, no errors.
    """
    if not 2 <= rows <= MAX_ROWS or stacked_out % 2 or not _kernels_allowed(device):
        return None
    return _swiglu_choice(in_features, stacked_out)


@functools.lru_cache(maxsize=None)
def _swiglu_choice(in_features: int, stacked_out: int) -> SkinnyConfig | None:
    key = (in_features, stacked_out)
    if key in _SM90_SWIGLU_GATE_UP:
        return _SM90_SWIGLU_GATE_UP[key]
    gemm = _SM90_SIXTEEN_ROWS.get(key)
    if gemm is None or gemm.kernel != "dot" or gemm.split_k != 1:
        return None
    return gemm._replace(block_n=max(16, gemm.block_n // 2))


# The one-row rule is used up to the sizes it was checked at (skinny_gemm.json: 1.02-2.76x over
# cuBLAS on 15 unlisted shapes of Qwen2.5-0.5B / 1.5B, SmolLM2-135M and DFlash drafters, K up to
# 20,480, N up to 17,920).
RULE_MAX_IN_FEATURES = 20480
RULE_MAX_OUT_FEATURES = 17920


def one_row_rule(in_features: int, out_features: int) -> SkinnyConfig:
    """Row-kernel tiles for an unlisted one-row shape, fitted to the H200 table.

    block_n = out_features / 256 rounded down to a power of two in [4, 32] (about 224+ column
    blocks, so every SM streams weights); block_k 256 with 4 warps for 32-wide blocks, else 1,024
    with 8 warps (512 when in_features < 1,024 and block_n >= 8). Pure arithmetic, no errors."""
    block_n = 4
    while block_n < 32 and out_features // (2 * block_n) >= 256:
        block_n *= 2
    if block_n == 32:
        return SkinnyConfig("row", 32, 256, 4, 3)
    return SkinnyConfig("row", block_n, 1024 if in_features >= 1024 or block_n <= 4 else 512, 8, 3)


def config_for(rows: int, in_features: int, out_features: int, device: torch.device) -> SkinnyConfig | None:
    """The kernel and tiles for x [rows, in_features] @ W [out_features, in_features].T.

    Args:
        rows: rows of x; in_features, out_features: the weight's shape; device: x's device.
    Returns:
        one row: the table entry (None where cuBLAS measured as fast), else `one_row_rule` up to
        RULE_MAX_IN_FEATURES / RULE_MAX_OUT_FEATURES; 2-16 rows: the 16-row table entry; else
        None (cuBLAS). Only sm90 GPUs take the kernels (measured on the H200; the H100 has the
        same architecture and SM count but was not measured); off CUDA (Triton's interpreter in
        tests) the choice is made as on sm90; None for every shape when BLOCKDRAFT_SKINNY_GEMM=0
        was set when this module was imported. Called for every linear layer call: the
        environment and the GPU's capability are read once, the choice per shape is cached.
    """
    if not 1 <= rows <= MAX_ROWS or not _kernels_allowed(device):
        return None
    return _choice(rows == 1, in_features, out_features)


def _kernels_allowed(device: torch.device) -> bool:
    """Not switched off (BLOCKDRAFT_SKINNY_GEMM=0) and, on CUDA, an sm90 GPU."""
    if not ENABLED:
        return False
    return device.type != "cuda" or _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _choice(one_row: bool, in_features: int, out_features: int) -> SkinnyConfig | None:
    """`config_for` on sm90 (tables, then the one-row rule within its checked sizes)."""
    key = (in_features, out_features)
    if not one_row:
        return _SM90_SIXTEEN_ROWS.get(key)
    if key in _SM90_ONE_ROW:
        return _SM90_ONE_ROW[key]
    if in_features <= RULE_MAX_IN_FEATURES and out_features <= RULE_MAX_OUT_FEATURES:
        return one_row_rule(in_features, out_features)
    return None


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@triton.jit
def _silu_mul_input(gate, up):
    """silu(gate) * up rounded as `blockdraft.kernels.activation.silu_mul` (silu rounded to the
    dtype, then the product), so a fused SwiGLU down projection reads the same input values."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _gemv_kernel(
    x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_x_row, stride_up_row, stride_w_row, stride_y_row,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N), rows): y[row, n-block] = x[row] @ W[n-block].T (+ bias); the
    products accumulate per (n, k) lane in float32 and are summed over K once at the end.
    GATED: the row is silu(x[row]) * up[row] (`_silu_mul_input`) instead of x[row]."""
    row = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w_row
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + row * stride_x_row + k, mask=k_ok, other=0.0)
        if GATED:
            x = _silu_mul_input(x, tl.load(up_ptr + row * stride_up_row + k, mask=k_ok, other=0.0))
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y_row + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _skinny_dot_kernel(
    x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x_row, stride_up_row,
    stride_w_row, stride_y_row,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): y[:M, n-block] = x[:M] @ W[n-block].T (+ bias), M <= BLOCK_M.
    GATED: the rows are silu(x[:M]) * up[:M] (`_silu_mul_input`) instead of x[:M].

    SPLIT_K > 1 (more programs for narrow N): program (n-block, s) sums the s-th share of K's
    tiles into float32 partials part[s, :, n-block]; the last of the n-block's programs to finish
    (counter in count_ptr, reset by it) adds the partials in split order, so the result does not
    depend on which program finishes last. The barrier orders every thread's partial stores
    before the release (acq_rel) increment; the partials are read past L1 (".cg")."""
    m = tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w_row
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_x_row
    up_rows = up_ptr + m[:, None].to(tl.int64) * stride_up_row
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = tl.program_id(1) * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            x = _silu_mul_input(x, tl.load(up_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0))
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if SPLIT_K > 1:
        part_rows = (tl.program_id(1) * BLOCK_M + m[:, None]).to(tl.int64) * N
        tl.store(part_ptr + part_rows + n[None, :], acc, mask=n_ok[None, :])
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") != SPLIT_K - 1:
            return
        tl.store(count_ptr + pid_n, 0)
        s = tl.arange(0, SPLIT_K)
        offsets = (s[:, None, None] * BLOCK_M + m[None, :, None]).to(tl.int64) * N + n[None, None, :]
        acc = tl.sum(tl.load(part_ptr + offsets, mask=n_ok[None, None, :], other=0.0, cache_modifier=".cg"), axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + m[:, None].to(tl.int64) * stride_y_row + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _skinny_swiglu_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_x_row, stride_w_row, stride_y_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N),): y[:M, n-block] = silu(g) * u with g = x[:M] @ W[n-block].T and
    u = x[:M] @ W[N + n-block].T (W = [gate; up], 2N rows), M <= BLOCK_M. g and u are rounded to
    y's dtype first, as the gate_up GEMM's output is, then `_silu_mul_input` rounds as the
    activation kernel does."""
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    gate_rows = w_ptr + n[:, None].to(tl.int64) * stride_w_row
    up_rows = w_ptr + (n + N)[:, None].to(tl.int64) * stride_w_row
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_x_row
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        acc_gate += tl.dot(x, tl.trans(tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)),
                           input_precision=DOT_PRECISION)  # fmt: skip
        acc_up += tl.dot(x, tl.trans(tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)),
                         input_precision=DOT_PRECISION)  # fmt: skip
    dtype = y_ptr.dtype.element_ty
    y = _silu_mul_input(acc_gate.to(dtype), acc_up.to(dtype))
    y_ptrs = y_ptr + m[:, None].to(tl.int64) * stride_y_row + n[None, :]
    tl.store(y_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


SPLIT_COUNTER_SLOTS = 8192  # n-blocks of one split-K launch; counters are shared by all launches
_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The persistent int32 zero counters (SPLIT_COUNTER_SLOTS per device) of split-K launches:
    every launch leaves them at zero, so launches and CUDA-graph replays on one stream share them.

    Raises:
        ValueError: more than SPLIT_COUNTER_SLOTS column blocks.
        RuntimeError: first needed inside a CUDA-graph capture (run the layer once eagerly first,
            as the engine's warm-up does).
    """
    if needed > SPLIT_COUNTER_SLOTS:
        raise ValueError(f"split-K needs one counter per column block: {needed} > {SPLIT_COUNTER_SLOTS}")
    counters = _SPLIT_COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K counters must be allocated outside a CUDA-graph capture: "
                               "run the layer once eagerly before capturing")  # fmt: skip
        counters = _SPLIT_COUNTERS[device] = torch.zeros(SPLIT_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return counters


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T + bias [out] with the kernel and tiles of `config`; with
    `up`, (silu(x) * up) @ weight.T + bias: a SwiGLU down projection that reads the gate and up
    projections directly, saving the activation's launch and its output's round trip.

    Args:
        x: [rows, in_features]: up to MAX_ROWS rows for the dot kernel, up to 65,535 for the row
            kernel (one grid row each); unit column stride (any row stride). On CUDA, x must be
            on the current device (the launch goes there, as for the other kernels in
            blockdraft.kernels; the engine runs on one device).
        weight: [out_features, in_features], contiguous, on x's device in x's dtype (float16 /
            bfloat16; float32 for tests, the dot kernel then multiplying in IEEE float32).
        bias: contiguous [out_features] or None.
        config: from `config_for` (or a test's choice).
        up: None, or x's shape, dtype and device with unit column stride (any row stride: e.g.
            x and up the two halves of a stacked gate_up output); silu(x) * up is rounded to the
            dtype as `blockdraft.kernels.activation.silu_mul` rounds it, so the result equals
            skinny_linear(silu_mul(x, up), ...) bit for bit.
    Returns:
        [rows, out_features], new contiguous tensor in x's dtype; float32 accumulation, so it
        agrees with F.linear within rounding (another summation order), not bit for bit.
    Raises:
        ValueError: shapes, dtypes, devices or strides outside the above, or an unknown kernel.
    """
    if config.kernel not in ("row", "dot"):
        raise ValueError(f"config.kernel must be 'row' or 'dot', got {config.kernel!r}")
    split_k = config.split_k
    if split_k < 1 or split_k & (split_k - 1) or (split_k > 1 and config.kernel != "dot"):
        raise ValueError(f"config.split_k must be a power of two (> 1 only for the dot kernel), got {split_k}")
    check_linear_args(x, weight, bias)
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype or up.device != x.device or up.stride(1) != 1):
        raise ValueError(f"up must match x ({tuple(x.shape)}, {x.dtype}, {x.device}, unit column stride), got "
                         f"{tuple(up.shape)}, {up.dtype}, {up.device}, strides {up.stride()}")  # fmt: skip
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if config.kernel == "dot" and rows > MAX_ROWS:
        raise ValueError(f"the dot kernel takes at most {MAX_ROWS} rows, got {rows}")
    if config.kernel == "row" and rows > 65535:
        raise ValueError(f"the row kernel takes at most 65535 rows (one grid row each), got {rows}")
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return y
    b = bias if bias is not None else weight  # placeholders, never read without HAS_BIAS / GATED
    u = up if up is not None else x
    grid_n = triton.cdiv(out_features, config.block_n)
    tiles = dict(HAS_BIAS=bias is not None, GATED=up is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip
    _launch(x, u, weight, b, y, rows, in_features, out_features, grid_n, config, tiles)
    return y


def _launch(x, u, weight, b, y, rows, in_features, out_features, grid_n, config, tiles) -> None:
    """Launch the kernel of `config` on the current device (arguments checked by `skinny_linear`)."""
    if config.kernel == "row":
        _gemv_kernel[(grid_n, rows)](
            x, u, weight, b, y, out_features, in_features, x.stride(0), u.stride(0), weight.stride(0), y.stride(0),
            **tiles,
        )  # fmt: skip
        return
    part = counters = y  # placeholders, unread without split-K
    if config.split_k > 1:
        part = torch.empty(config.split_k * MAX_ROWS * out_features, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid_n)
    _skinny_dot_kernel[(grid_n, config.split_k)](
        x, u, weight, b, y, part, counters, rows, out_features, in_features, x.stride(0), u.stride(0),
        weight.stride(0), y.stride(0), BLOCK_M=MAX_ROWS, SPLIT_K=config.split_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **tiles,
    )  # fmt: skip


def skinny_swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor, config: SkinnyConfig) -> torch.Tensor:
    """SwiGLU's first half in one launch: silu(x @ W_gate.T) * (x @ W_up.T) for a stacked gate_up
    weight [2I, in] (gate rows first, as `GatedMLP.gate_up_proj`), no bias.

    Args:
        x: [rows <= MAX_ROWS, in_features], unit column stride, on the weight's device and dtype
            (float16 / bfloat16; float32 for tests, multiplying in IEEE float32).
        gate_up_weight: [2I, in_features], contiguous.
        config: a dot-kernel config without split-K (`swiglu_config_for`); block_n counts the
            columns of each half that one program computes.
    Returns:
        [rows, I], new contiguous tensor in x's dtype: each projection accumulated in float32 and
        rounded to the dtype, then the activation rounded as `blockdraft.kernels.activation.silu_mul`,
        so it equals the activation kernel applied to the gate_up GEMM within that GEMM's
        rounding (the same tl.dot sums; bit for bit where both use one block_k).
    Raises:
        ValueError: shapes, dtypes, devices or strides outside the above, an odd number of weight
            rows, or a config that is not the dot kernel without split-K.
    """
    if config.kernel != "dot" or config.split_k != 1:
        raise ValueError(f"skinny_swiglu needs a dot-kernel config without split-K, got {config}")
    if x.dim() != 2 or gate_up_weight.dim() != 2 or x.shape[1] != gate_up_weight.shape[1]:
        raise ValueError(f"x must be [rows, in] and gate_up_weight [2 * I, in], got {tuple(x.shape)} and "
                         f"{tuple(gate_up_weight.shape)}")  # fmt: skip
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight must stack gate and up (an even number of rows), got {gate_up_weight.shape[0]}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or gate_up_weight.dtype != x.dtype:
        raise ValueError(f"x and gate_up_weight must share one of float16, bfloat16, float32, got {x.dtype} and "
                         f"{gate_up_weight.dtype}")  # fmt: skip
    if gate_up_weight.device != x.device:
        raise ValueError(f"x and gate_up_weight must be on one device, got {x.device} and {gate_up_weight.device}")
    if x.stride(1) != 1 or not gate_up_weight.is_contiguous():
        raise ValueError(f"x needs unit column stride and gate_up_weight must be contiguous, got strides "
                         f"{x.stride()} and {gate_up_weight.stride()}")  # fmt: skip
    rows, in_features = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_swiglu takes at most {MAX_ROWS} rows, got {rows}")
    half = gate_up_weight.shape[0] // 2
    y = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    if rows == 0 or half == 0:
        return y
    _skinny_swiglu_kernel[(triton.cdiv(half, config.block_n),)](
        x, gate_up_weight, y, rows, half, in_features, x.stride(0), gate_up_weight.stride(0), y.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y
