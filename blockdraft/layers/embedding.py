"""Token embedding table that doubles as the tied LM head."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from blockdraft.layers.linear import pack_weight, packed_linear


class VocabEmbedding(nn.Module):
    """Embedding weight [vocab, hidden] (HF layout); `logits` uses it as a tied LM head.

    After `pack_()` the LM head uses a oneDNN-packed copy (see blockdraft.layers.linear); the
    dense table stays for the lookup (and for LM-head calls that need autograd). Parameters are
    left uninitialised (weights are always loaded).
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.packed_head: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden] (the weight's rows, copied exactly).

        On CUDA without autograd, indexing rather than F.embedding: the latter's index_select
        takes a kernel whose threads loop over the ids one after another when there are at most
        16, which cost 8.3 us for a 16-row verify or draft block at hidden size 4096 on the H200
        (docs/benchmarks/gpu.md "Session 26"); indexing spreads the rows over all threads.
        """
        if input_ids.is_cuda and not (torch.is_grad_enabled() and self.weight.requires_grad):
            return self.weight[input_ids]
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: hidden [N, hidden] -> [N, vocab] in the weight dtype."""
        if self.packed_head is not None and not (hidden.requires_grad and torch.is_grad_enabled()):
            return packed_linear(hidden, self.packed_head, None)
        return F.linear(hidden, self.weight)

    def pack_(self) -> None:
        """Add a oneDNN-packed copy of the table for `logits` (CPU; costs one more table)."""
        self.packed_head = pack_weight(self.weight)
