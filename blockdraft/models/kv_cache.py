"""Paged KV cache tensors for a target model (one (k, v) pair per layer, all in one allocation)."""

from __future__ import annotations

import torch

from blockdraft.config import ModelConfig


def allocate_kv_caches(
    config: ModelConfig,
    num_kv_blocks: int,
    kv_block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed paged caches: list of num_hidden_layers (k_cache, v_cache) pairs.

    Each cache is [num_kv_blocks, kv_block_size, num_kv_heads, head_dim] in `dtype`, a
    contiguous view into one [layers, 2, ...] buffer. Zeros (not empty) so kernels that read a
    whole page never see NaN garbage in unwritten slots.
    Raises:
        ValueError: num_kv_blocks or kv_block_size < 1.
    """
    if num_kv_blocks < 1 or kv_block_size < 1:
        raise ValueError(f"num_kv_blocks ({num_kv_blocks}) and kv_block_size ({kv_block_size}) must be >= 1")
    shape = (num_kv_blocks, kv_block_size, config.num_key_value_heads, config.head_dim)
    buf = torch.zeros(config.num_hidden_layers, 2, *shape, dtype=dtype, device=device)
    return [(buf[i, 0], buf[i, 1]) for i in range(config.num_hidden_layers)]
