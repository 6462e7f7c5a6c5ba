"""SwiGLU activation silu(gate) * up as one Triton kernel (2D grid: rows x column blocks).

Rounding follows `F.silu(gate) * up` in torch: silu in fp32, rounded to the input dtype, then
the product in fp32, rounded to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_ptr, gate_row_stride, up_ptr, up_row_stride, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (silu * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one launch.

    Args:
        gate, up: [rows, I] of one float dtype, any row stride, unit column stride
            (e.g. the two halves of a stacked gate_up projection).
    Returns:
        [rows, I] new contiguous tensor in that dtype.
    Raises:
        ValueError: shape / dtype / device mismatch, or a non-unit column stride.
    """
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"gate and up must be [rows, I] of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype or not gate.is_floating_point() or gate.device != up.device:
        raise ValueError(
            f"gate ({gate.dtype}, {gate.device}) and up ({up.dtype}, {up.device}) must share a float dtype and device"
        )
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"gate and up need unit column stride, got {gate.stride()} and {up.stride()}")
    rows, n_cols = gate.shape
    out = torch.empty((rows, n_cols), dtype=gate.dtype, device=gate.device)
    if rows and n_cols:
        grid = (rows, triton.cdiv(n_cols, _BLOCK))
        _silu_mul_kernel[grid](gate, gate.stride(0), up, up.stride(0), out, n_cols, BLOCK=_BLOCK, num_warps=4)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * I] (gate first, then up; `GatedMLP.gate_up_proj` output) -> [rows, I].

    Raises:
        ValueError: not 2-D, or an odd last dim.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * I], got {tuple(gate_up.shape)}")
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul(gate, up)
