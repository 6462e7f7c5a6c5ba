"""RMSNorm and residual-add + RMSNorm as one Triton kernel each (one program per row).

Rounding follows HF Llama/Qwen (and `blockdraft.layers.fused_ops.rms_norm_ref`): the row is
normalised in fp32, rounded to the input dtype, then multiplied by the weight (fp32 product,
rounded to the output dtype). The residual sum is rounded to the input dtype before it is
normalised, exactly like `residual = x + residual` in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_row_stride,
    res_ptr,
    res_row_stride,
    res_out_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def _as_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """[..., N] -> [rows, N] with unit column stride (a view when the layout allows it)."""
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) for x {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = _as_rows(x, "x")
    r2 = _as_rows(residual, "residual") if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x2, memory_format=torch.contiguous_format) if residual is not None else out
    n_rows, n_cols = x2.shape
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, x2.stride(0), r2, r2.stride(0), res_out, weight, out, n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape) if residual is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = round(x / sqrt(mean(x^2) + eps)) * weight over the last dim, in one launch.

    Args:
        x: [..., N] float tensor (any layout; its last dim is made contiguous if it is not).
        weight: [N] contiguous, on x's device.
        eps: added to the mean square.
    Returns:
        [..., N] contiguous, dtype promote(x.dtype, weight.dtype).
    Raises:
        ValueError: non-float x, weight of the wrong shape / device / layout.
    """
    _check_weight(weight, x)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (rounded to x.dtype); normed = rms_norm(new_residual), in one launch.

    Args:
        x, residual: [..., N], same shape and dtype (e.g. a sublayer output and the residual stream).
        weight: [N] contiguous. eps: added to the mean square.
    Returns:
        (normed [..., N] in promote(x.dtype, weight.dtype), new_residual [..., N] in x.dtype);
        both are new contiguous tensors (the inputs are not modified).
    Raises:
        ValueError: shape / dtype / device mismatch between x and residual, or a bad weight.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}, {residual.device}) must match "
            f"x ({tuple(x.shape)}, {x.dtype}, {x.device})"
        )
    _check_weight(weight, x)
    normed, new_residual = _launch(x, residual, weight, eps)
    return normed, new_residual
