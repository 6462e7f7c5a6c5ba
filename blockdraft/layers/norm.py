"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like HF Llama/Qwen."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.layers.fused_ops import UsesFusedOps, fused_add_rms_norm, rms_norm


class RMSNorm(UsesFusedOps, nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim of size `hidden_size`.

    Input [..., hidden_size] of any float dtype; output has the input's dtype (HF rounding:
    see `blockdraft.layers.fused_ops.rms_norm_ref`). CUDA inputs use one Triton kernel.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual` (same shape and dtype as x): (norm(x + residual), x + residual).

        The residual form is the fused residual-add of a pre-norm decoder layer (one launch on CUDA).
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.fused_ops)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.fused_ops)
