"""RotaryEmbedding's cos / sin table (used by CUDA calls): built by the same float32 ops as the
per-call angles, so a gather from it equals them bit for bit; positions past it are clamped;
rebuilt after inv_freq is reset. Checked here on CPU tensors (the table code is device-agnostic);
tests/gpu checks the CUDA path itself."""

from __future__ import annotations

import pytest
import torch

from blockdraft.layers.rotary import TABLE_MARGIN, RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}],
                         ids=["default", "llama3"])  # fmt: skip
def test_table_rows_equal_the_angles_computed_per_call(dtype, scaling):
    rope = RotaryEmbedding(16, 10000.0, scaling, max_positions=300)
    table = rope._table(dtype, torch.device("cpu"))
    assert table.shape == (300 + TABLE_MARGIN, 2, 16) and table.dtype == dtype
    positions = torch.tensor([0, 1, 7, 63, 64, 299, 300 + TABLE_MARGIN - 1, 5, 5])
    cos, sin = rope._angles_cos_sin(positions, dtype)
    assert torch.equal(table[positions, 0:1], cos) and torch.equal(table[positions, 1:2], sin)


def test_no_table_without_max_positions_and_tables_reset_with_inv_freq():
    assert RotaryEmbedding(16, 10000.0)._table(torch.float32, torch.device("cpu")) is None
    rope = RotaryEmbedding(16, 10000.0, max_positions=32)
    first = rope._table(torch.float32, torch.device("cpu"))
    assert rope._table(torch.float32, torch.device("cpu")) is first  # built once per (dtype, device)
    assert rope._table(torch.bfloat16, torch.device("cpu")) is not first
    rope.reset_inv_freq()
    assert rope._table(torch.float32, torch.device("cpu")) is not first


def test_cpu_calls_compute_the_angles_as_before():
    rope = RotaryEmbedding(16, 10000.0, max_positions=32)
    positions = torch.tensor([3, 40])
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert not rope._tables  # CPU: no table built
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())
