"""SwiGLU feed-forward block (Shazeer 2020) with gate and up projections stacked in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.layers.fused_ops import UsesFusedOps, silu_and_mul, swiglu_mlp
from blockdraft.layers.linear import Linear, StackedLinear


class GatedMLP(UsesFusedOps, nn.Module):
    """down(silu(gate(x)) * up(x)); HF names gate_proj / up_proj (stacked) and down_proj, no biases.

    Input / output [rows, hidden_size] in the parameters' dtype. Parameters are left
    uninitialised (weights are always loaded). On CUDA silu(gate) * up is one Triton kernel, part
    of the gate/up projection's launch for 2-16 rows (verify / draft-block rows), or part of the down
    projection's launch for one row of the shapes where that measured faster
    (`blockdraft.layers.fused_ops.swiglu_mlp`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        shards = [("gate_proj", intermediate_size), ("up_proj", intermediate_size)]
        self.gate_up_proj = StackedLinear(hidden_size, shards, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.fused_ops and gate_up.packed_weight is None and down.packed_weight is None:
            return swiglu_mlp(x, gate_up.weight, down.weight, gate_up.fused_ops and down.fused_ops,
                              gate_up.batch_invariant or down.batch_invariant)
        return down(silu_and_mul(gate_up(x), self.fused_ops))
