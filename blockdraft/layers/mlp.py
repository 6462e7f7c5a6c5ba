"""SwiGLU feed-forward block (Shazeer 2020) with gate and up projections stacked in one matmul."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from blockdraft.layers.linear import Linear, StackedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); HF names gate_proj / up_proj (stacked) and down_proj, no biases.

    Input / output [rows, hidden_size] in the parameters' dtype. Parameters are left
    uninitialised (weights are always loaded).
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        shards = [("gate_proj", intermediate_size), ("up_proj", intermediate_size)]
        self.gate_up_proj = StackedLinear(hidden_size, shards, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
