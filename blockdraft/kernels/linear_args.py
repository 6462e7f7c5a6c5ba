"""Argument checks shared by the GEMM kernels' wrappers (`skinny_gemm`, `invariant_gemm`): plain
torch, no Triton, so the kernel modules stay self-contained for the interpreter tests."""

from __future__ import annotations

import torch


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x [rows, in] (float16 / bfloat16 / float32, unit column stride), weight [out, in]
    (contiguous), bias None or a contiguous [out]: one dtype, one device.

    Raises:
        ValueError: the first condition that fails, naming the shapes, dtypes, devices or strides.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [rows, in] and weight [out, in], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")  # fmt: skip
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, weight and bias must be on one device, got {x.device}, {weight.device}, "
                         f"{None if bias is None else bias.device}")  # fmt: skip
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x needs unit column stride and weight must be contiguous, got strides {x.stride()} "
                         f"and {weight.stride()}")  # fmt: skip
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}], got {tuple(bias.shape)} "
                         f"with strides {bias.stride()}")  # fmt: skip
