"""y = x @ W.T (+ bias) whose every row is the same bits whatever the number of rows: batch invariance.

Why: greedy DFlash is lossless only if the target's logits for a token are the same whether the
token is decoded alone (one row) or verified inside a block of K + 1 rows, and, with several
requests in flight, whatever else shares the step. cuBLAS and the skinny-GEMM kernels
(`blockdraft.kernels.skinny_gemm`) pick their kernel, tiles and split-K by row count, so a row's
float32 sum runs in another order at 1 and at 16 rows: its bf16 result can differ in the last
bit, and a near-tie argmax can flip (issue 5's "divergences at near-ties"). The same problem and
fix as vLLM's VLLM_BATCH_INVARIANT / SGLang's --enable-deterministic-inference (Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025: fixed tiles, no split-K, per-row reductions).

Kernel (`_invariant_gemm_kernel`): program (row block of BLOCK_M rows, column block)
accumulates tl.dot over K in BLOCK_K steps, in float32, in one fixed order, adds the bias in
float32 and rounds once to the output dtype. The tiles depend only on (in_features,
out_features, dtype, the GPU's shared memory) (`config_for`), never on the row count, and the row count is not a
specialised kernel argument, so every batch runs the same compiled kernel: the instruction that
sums row r's products is the same for 1 row, 16 rows or a 2,048-row prefill chunk, and padding
rows (masked loads read 0) take no part in it (the 23 tilings of
`python -m blockdraft.bench.invariant_gemm --sweep` that compiled on the H100 passed its check at
three rows of a 2,048-row call against one-row calls). Triton still specialises the pointers' and
strides' alignment, which changes how tiles are loaded, not the order of the sums. No split-K
keeps one row's narrow projections on few programs, and fixed tiles cannot suit every row count:
the price of the mode (docs/benchmarks/gpu.md, "Session 43").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockdraft.kernels.linear_args import check_linear_args

BLOCK_M = 64  # rows per program (`config_for`); fixed per weight shape, which the invariance rests on


class InvariantConfig(NamedTuple):
    """Tiles of one weight shape: block_n output features and block_k input features per tile
    (powers of two >= 16), num_warps and num_stages as in Triton, block_m rows per program (a
    power of two >= 16). Any tiles keep rows invariant as long as one weight shape always gets
    the same ones, whatever the row count."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M


# Shared memory left aside for what Triton keeps beside the pipelined tiles (epilogue, barriers).
_SMEM_MARGIN = 8192


@functools.lru_cache(maxsize=None)
def config_for(
    in_features: int, out_features: int, dtype: torch.dtype, max_smem: int | None = None
) -> InvariantConfig:
    """Tiles for a weight [out_features, in_features] of `dtype` on a GPU with `max_smem` bytes of
    shared memory per block (None: no limit); a function of these alone, never of the row count.

    64 rows per program; 32 output features for narrow outputs (<= 2,048: q/k/v, o and down
    projections of small models) else 64; 256 input features per step for wide inputs (>= 4,096:
    down projections, and every layer of 4,096-wide models such as Qwen3-8B, whose shapes were
    not swept) else 128; 4 pipeline stages for narrow outputs else 3. Fitted to the sweep of
    `python -m blockdraft.bench.invariant_gemm --sweep` (H100, Qwen2.5-0.5B's shapes and LM head
    at 1 / 16 / 192 / 2,048 rows, decode rows weighted most;
    docs/benchmarks/gpu-2026-12-05-s43/invariant_gemm_sweep.json): against the first tiles (16-row
    programs), one row -5.2 to +0.8 us per call (the down projection 16.6 -> 11.4 us), 192 rows
    1.9-2.9x faster, 2,048 rows 2.8-4.4x. Where the pipelined tiles ((block_m + block_n) x
    block_k x stages elements) would not fit `max_smem` (GPUs with less shared memory than the
    H100's 227 KiB: A100, sm86 / sm89), stages drop to 2, then block_k halves: those tiles were
    not measured. float32 (tests) keeps 128-wide K steps and 2 stages. Pure arithmetic, no errors."""
    narrow = out_features <= 2048
    block_n = 32 if narrow else 64
    block_k = 256 if in_features >= 4096 and dtype != torch.float32 else 128
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    stages = 2 if dtype == torch.float32 else 4 if narrow else 3
    if max_smem is not None:
        elem = torch.finfo(dtype).bits // 8
        budget = max_smem - _SMEM_MARGIN
        while stages * (BLOCK_M + block_n) * block_k * elem > budget and (stages > 2 or block_k > 32):
            if stages > 2:
                stages -= 1
            else:
                block_k //= 2
    return InvariantConfig(block_n, block_k, 4, stages, BLOCK_M)


@functools.lru_cache(maxsize=None)
def _max_shared_memory(device: torch.device) -> int | None:
    """Shared memory per block (opt-in maximum) of a CUDA device, bytes; None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@triton.jit(do_not_specialize=["rows"])
def _invariant_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, rows, out_features, in_features,
    stride_x, stride_w, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (row blocks, column blocks): y[rows, cols] = x[rows] @ w[cols].T (+ b[cols])."""
    # Row blocks vary fastest, so the programs that read one column block of W run together (L2).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < rows
    c_ok = c < out_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        x = tl.load(x_ptr + r[:, None] * stride_x + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + c[:, None] * stride_w + k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + r[:, None] * stride_y + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])  # fmt: skip


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: InvariantConfig | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, each output row a function of its own input row only (module docstring).

    Args:
        x: [rows, in_features], float16 / bfloat16 / float32 (float32 multiplies in IEEE float32),
            unit column stride (any row stride).
        weight: [out_features, in_features], contiguous, x's dtype and device.
        bias: contiguous [out_features] in x's dtype, or None.
        out_dtype: the result's dtype (default x's; float16 / bfloat16 / float32): float32 keeps
            the float32 accumulation unrounded (the LM head's --enable-fp32-lm-head).
        out: write there instead of a new tensor: [rows, out_features] of out_dtype, unit column
            stride (CUDA graphs' logits buffers).
        config: tiles (benchmarks and tests); None = `config_for` (what keeps rows invariant: the
            same tiles for a weight shape on every call).
    Returns:
        [rows, out_features] (`out` when given). Agrees with F.linear within the output dtype's
        rounding (another summation order), and row i is the same bits for any x whose row i is
        the same (tests/gpu/test_batch_invariant_gpu.py).
    CUDA tensors (CPU ones only under Triton's interpreter, in tests); no backward.
    Raises:
        ValueError: shapes, dtypes, devices or strides outside the above.
    """
    check_linear_args(x, weight, bias)
    rows, in_features = x.shape
    out_features = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if out is None:
        out = torch.empty((rows, out_features), dtype=out_dtype, device=x.device)
    elif out.shape != (rows, out_features) or out.dtype != out_dtype or out.device != x.device or (
            out_features > 1 and out.stride(1) != 1):  # fmt: skip
        raise ValueError(f"out must be [{rows}, {out_features}] {out_dtype} on {x.device} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")  # fmt: skip
    if rows == 0 or out_features == 0:
        return out
    config = config or config_for(in_features, out_features, x.dtype, _max_shared_memory(x.device))
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(out_features, config.block_n))
    _invariant_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, rows, out_features, in_features,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
