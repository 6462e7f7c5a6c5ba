"""SwiGLU feed-forward block (Shazeer 2020) with gate and up projections stacked in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.layers.fused_ops import UsesFusedOps, silu_and_mul
from blockdraft.layers.linear import Linear, StackedLinear


class GatedMLP(UsesFusedOps, nn.Module):
    """down(silu(gate(x)) * up(x)); HF names gate_proj / up_proj (stacked) and down_proj, no biases.

    Input / output [rows, hidden_size] in the parameters' dtype. Parameters are left
    uninitialised (weights are always loaded). On CUDA silu(gate) * up is one Triton kernel.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        shards = [("gate_proj", intermediate_size), ("up_proj", intermediate_size)]
        self.gate_up_proj = StackedLinear(hidden_size, shards, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused_ops))
