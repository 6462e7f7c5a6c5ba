"""The one interface every paged-attention backend implements (models call it, backends provide it)."""

from __future__ import annotations

from typing import Protocol

import torch

from blockdraft.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes this forward's K/V into the paged cache (causal forwards) and attends.

    q [rows, heads, head_dim]; k, v [rows, kv_heads, head_dim]; k_cache, v_cache
    [num_kv_blocks, kv_block_size, kv_heads, head_dim]. Returns [rows, heads, head_dim].
    A backend with the attribute `accepts_kv_written = True` also takes `kv_written=True`: the
    caller (the q/k RoPE kernel of `blockdraft.layers.attention.Attention`) has written the
    K/V already, and the backend only attends.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        causal: bool = True,
    ) -> torch.Tensor: ...
