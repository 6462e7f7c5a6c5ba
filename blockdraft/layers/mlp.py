"""SwiGLU feed-forward block (Shazeer 2020) with gate and up projections stacked in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.layers.fused_ops import UsesFusedOps, silu_and_mul, silu_mul_linear
from blockdraft.layers.linear import Linear, StackedLinear


class GatedMLP(UsesFusedOps, nn.Module):
    """down(silu(gate(x)) * up(x)); HF names gate_proj / up_proj (stacked) and down_proj, no biases.

    Input / output [rows, hidden_size] in the parameters' dtype. Parameters are left
    uninitialised (weights are always loaded). On CUDA silu(gate) * up is one Triton kernel, or
    part of the down projection's skinny-GEMM launch for one row of the shapes where that measured
    faster (`blockdraft.kernels.skinny_gemm.fuses_swiglu`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        shards = [("gate_proj", intermediate_size), ("up_proj", intermediate_size)]
        self.gate_up_proj = StackedLinear(hidden_size, shards, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        if self.fused_ops and down.fused_ops and down.packed_weight is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return silu_mul_linear(gate, up, down.weight, down.bias)
        return down(silu_and_mul(gate_up, self.fused_ops))
