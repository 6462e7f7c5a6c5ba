"""KV pool size from GPU memory: the arithmetic, as pure functions (unit-tested on CPU).

pages = (total * gpu_memory_utilization - used_now - reserved_activations) // bytes_per_page

total: the device's memory; used_now: what is in use after loading the weights (all processes,
the CUDA context included; torch.cuda.mem_get_info); reserved_activations: the peak activation
memory of a profile forward at the step limits (twice when CUDA graphs are captured: their
private pool holds a second set, see blockdraft.runner.memory_profile); bytes_per_page: one
page in every KV layer that indexes the pool, the target's and the drafter's (same page ids).
"""

from __future__ import annotations

import math


def kv_bytes_per_page(kv_block_size: int, layers: list[tuple[int, int]], dtype_bytes: int) -> int:
    """Bytes of one page of `kv_block_size` tokens across `layers`, K and V.

    Args:
        layers: one (num_kv_heads, head_dim) per KV layer (target layers, then drafter layers).
        dtype_bytes: bytes per cache element (2 for bf16).
    """
    return sum(2 * kv_block_size * heads * dim * dtype_bytes for heads, dim in layers)


def num_kv_blocks_from_memory(
    total_bytes: int,
    used_bytes: int,
    activation_bytes: int,
    bytes_per_page: int,
    gpu_memory_utilization: float,
    kv_block_size: int,
    min_tokens: int,
) -> int:
    """Pages the pool can have within `gpu_memory_utilization` of the device.

    Args:
        total_bytes / used_bytes: device memory, and what is in use now (weights loaded).
        activation_bytes: memory to keep free for activations (profiled peak, graph pool).
        bytes_per_page: kv_bytes_per_page(...).
        gpu_memory_utilization: fraction of the device the engine may use, in (0, 1].
        kv_block_size: tokens per page.
        min_tokens: the pool must hold at least one request of this many tokens (the context
            length: max_model_len, else the model's max_position_embeddings).
    Raises:
        ValueError: utilization outside (0, 1]; or the budget leaves room for fewer than
            `min_tokens` tokens (the message names the knobs to turn).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = total_bytes * gpu_memory_utilization - used_bytes - activation_bytes
    pages = max(0, int(budget // bytes_per_page))
    need = math.ceil(min_tokens / kv_block_size)
    if pages < need:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves room for {pages} KV pages "
            f"({pages * kv_block_size} tokens), fewer than one request of {min_tokens} tokens needs "
            f"({need} pages of {bytes_per_page} bytes): the device has {total_bytes / gib:.1f} GiB, "
            f"{used_bytes / gib:.1f} GiB are in use (weights, other processes) and activations need "
            f"{activation_bytes / gib:.1f} GiB. Raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens / --max-num-seqs, or accept a shorter context: --max-model-len (or "
            f"--num-kv-blocks, which sets the pool and so caps the context)."
        )
    return pages
