"""KV pool sizing arithmetic (the pure part of sizing the pool from GPU memory)."""

import pytest

from blockdraft.config import CacheConfig
from blockdraft.runner.kv_budget import kv_bytes_per_page, num_kv_blocks_from_memory

GIB = 1 << 30


def test_bytes_per_page_counts_k_and_v_of_every_layer_target_and_drafter():
    target = [(2, 64)] * 24  # Qwen2.5-0.5B: 24 layers, 2 KV heads x 64
    drafter = [(2, 64)] * 2
    assert kv_bytes_per_page(16, target, 2) == 24 * 2 * 16 * 2 * 64 * 2
    assert kv_bytes_per_page(16, target + drafter, 2) == 26 * 2 * 16 * 2 * 64 * 2


def test_pages_are_the_budget_over_the_page_size():
    per_page = 1 << 20
    pages = num_kv_blocks_from_memory(
        total_bytes=80 * GIB, used_bytes=10 * GIB, activation_bytes=2 * GIB, bytes_per_page=per_page,
        gpu_memory_utilization=0.5, kv_block_size=16, min_tokens=4096,
    )  # fmt: skip
    assert pages == (40 - 10 - 2) * 1024
    full = num_kv_blocks_from_memory(80 * GIB, 10 * GIB, 2 * GIB, per_page, 1.0, 16, 4096)
    assert full == (80 - 12) * 1024


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01, 2.0])
def test_utilization_outside_0_1_is_refused(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        num_kv_blocks_from_memory(80 * GIB, 0, 0, 1 << 20, utilization, 16, 16)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=utilization)


def test_a_budget_below_one_max_length_request_names_the_knobs():
    # 1 GiB left, 1 MiB pages of 16 tokens: 1024 pages = 16384 tokens < 32768.
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization.*--num-kv-blocks") as err:
        num_kv_blocks_from_memory(10 * GIB, 8 * GIB, 1 * GIB, 1 << 20, 1.0, 16, 32768)
    assert "1024 KV pages" in str(err.value) and "32768 tokens" in str(err.value)
    # Used memory above the budget: zero pages, same error (never a negative pool).
    with pytest.raises(ValueError, match="leaves room for 0 KV pages"):
        num_kv_blocks_from_memory(10 * GIB, 9.5 * GIB, 0, 1 << 20, 0.9, 16, 16)
    assert num_kv_blocks_from_memory(10 * GIB, 8 * GIB, 0, 1 << 20, 1.0, 16, 32768) == 2048  # exactly enough
