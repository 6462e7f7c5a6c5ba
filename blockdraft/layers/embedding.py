"""Token embedding table that can double as the (tied) LM head, in either weight layout."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class VocabEmbedding(nn.Module):
    """Embedding [vocab, hidden] (HF layout) or, if `transposed`, stored as [hidden, vocab].

    The transposed layout makes the tied LM head (`logits`) a fast x @ Wt on CPU float32 (see
    blockdraft.layers.linear); the lookup then gathers columns, which costs little for T rows.
    Parameters are left uninitialised (weights are always loaded).
    """

    def __init__(self, vocab_size: int, hidden_size: int, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        shape = (hidden_size, vocab_size) if transposed else (vocab_size, hidden_size)
        self.weight = nn.Parameter(torch.empty(shape))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden] (contiguous)."""
        if self.transposed:
            return self.weight.index_select(1, input_ids).t().contiguous()
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: hidden [N, hidden] -> [N, vocab] in the weight dtype."""
        return hidden @ self.weight if self.transposed else F.linear(hidden, self.weight)

    def hf_view(self, param: str) -> torch.Tensor:
        """The weight as HF lays it out, [vocab, hidden]; a writable view."""
        data = getattr(self, param).data
        return data.t() if self.transposed else data
