"""Row-wise argmax over a vocabulary in two short launches (greedy tokens from logits).

`torch.argmax(logits, dim=-1)` reduces each row with one thread block, so a few rows of a 152K
vocabulary run on a few SMs: 8.6 us for one row and ~10-13 us for 16 on the H200 (profile of
the Qwen3-8B-shaped step, docs/benchmarks/gpu.md "Session 26"). Here stage 1 splits every row
into CHUNK-wide pieces, one program each (a [rows, ceil(V / CHUNK)] grid), and stage 2 reduces
each row's partial maxima. The result equals torch.argmax exactly: values are compared in fp32
(exact for fp16 / bf16), ties go to the lowest index, and a NaN counts as larger than everything
(the first NaN's index wins), as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # columns per stage-1 program: 8 KB of bf16, 38 programs per 152K-vocabulary row


@triton.jit
def _argmax_partial_kernel(
    x_ptr, x_row_stride, part_val_ptr, part_idx_ptr, n_cols, n_parts,
    CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, cols, n_cols), axis=0)
    x = tl.where(is_nan, float("-inf"), x)
    best = tl.argmax(x, axis=0, tie_break_left=True)
    best_val = tl.max(x, axis=0)
    has_nan = first_nan < n_cols
    out = row * n_parts + part
    tl.store(part_val_ptr + out, tl.where(has_nan, float("nan"), best_val))
    tl.store(part_idx_ptr + out, tl.where(has_nan, first_nan, part * CHUNK + best))


@triton.jit
def _argmax_combine_kernel(
    part_val_ptr, part_idx_ptr, out_ptr, out_stride, n_parts, n_cols,
    BLOCK_PARTS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_PARTS)
    mask = parts < n_parts
    val = tl.load(part_val_ptr + row * n_parts + parts, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * n_parts + parts, mask=mask, other=0)
    is_nan = val != val
    # Pieces are in column order and each holds its lowest best index, so the lowest piece
    # among equal maxima has the row's lowest index; with NaNs, the lowest first-NaN index.
    first_nan = tl.min(tl.where(is_nan, idx, n_cols), axis=0)
    best = tl.argmax(tl.where(is_nan, float("-inf"), val), axis=0, tie_break_left=True)
    best_idx = tl.sum(tl.where(parts == best, idx, 0), axis=0)
    tl.store(out_ptr + row * out_stride, tl.where(first_nan < n_cols, first_nan, best_idx).to(tl.int64))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, *, chunk: int = CHUNK) -> torch.Tensor:
    """Index of each row's largest value, == torch.argmax(x, dim=-1), in two launches.

    Args:
        x: [N, V] float32 / float16 / bfloat16 with unit column stride (e.g. logits), V >= 1.
        out: optional [N] int64 on x's device (any stride) to write into, e.g. a CUDA-graph buffer.
        chunk: columns per stage-1 program, a power of two >= 16 (tests use small ones).
    Returns:
        [N] int64 (out when given): ties -> lowest index; a NaN beats everything (first NaN wins).
    Raises:
        ValueError: x not 2-D, V == 0, a non-unit column stride, an unsupported dtype, a bad
            chunk, or an `out` of the wrong shape / dtype / device.
    """
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows needs x of shape [N, V] with V >= 1, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"argmax_rows supports float32 / float16 / bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"argmax_rows needs unit column stride, got strides {x.stride()}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    n_rows, n_cols = x.shape
    if out is None:
        out = torch.empty(n_rows, dtype=torch.int64, device=x.device)
    elif out.shape != (n_rows,) or out.dtype != torch.int64 or out.device != x.device:
        raise ValueError(
            f"out must be [{n_rows}] int64 on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if n_rows == 0:
        return out
    n_parts = triton.cdiv(n_cols, chunk)
    part_val = torch.empty(n_rows * n_parts, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(n_rows * n_parts, dtype=torch.int32, device=x.device)
    _argmax_partial_kernel[(n_rows, n_parts)](
        x, x.stride(0), part_val, part_idx, n_cols, n_parts, CHUNK=chunk, num_warps=4
    )
    _argmax_combine_kernel[(n_rows,)](
        part_val, part_idx, out, out.stride(0), n_parts, n_cols,
        BLOCK_PARTS=max(triton.next_power_of_2(n_parts), 2), num_warps=1,
    )  # fmt: skip
    return out
