"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like HF Llama/Qwen."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim of size `hidden_size`.

    Input [..., hidden_size] of any float dtype; output has the input's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm = x * rsqrt(mean(x^2) + eps) in one call (fewer ops than spelling it out).
        # HF normalises in fp32, rounds to the input dtype, then scales: fusing the weight is
        # bit-identical only in fp32, so other dtypes keep HF's order.
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)
