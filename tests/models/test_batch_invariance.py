"""Batch invariance on the CPU path: a row computed inside a DFlash verify block (K + 1 rows) equals,
bit for bit, the same row decoded alone. Greedy speculation is lossless only if it does: otherwise
a last-bit difference can flip a near-tie argmax (seen with the real Qwen 0.5B in bf16).

The shapes are the ones where the unfixed kernels differed on the dev box: a 4864-wide reduction
in a one-row matmul (oneDNN's GEMV path) and probs @ V over ~300 keys (the key dimension is split
differently for different key counts).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.attention.metadata import build_metadata
from blockdraft.attention.torch_ref import paged_attention
from blockdraft.layers.linear import cpu_packing_supported, pack_weight, packed_linear
from blockdraft.models import allocate_kv_caches, build_model
from tests.conftest import tiny_config

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features,out_features", [(4864, 896), (896, 2048)])
def test_packed_linear_rows_do_not_depend_on_the_row_count(dtype, in_features, out_features):
    if not cpu_packing_supported(dtype, "cpu"):
        pytest.skip("oneDNN weight packing is not available")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
    x = torch.randn(16, in_features, generator=g).to(dtype)
    packed = pack_weight(w)
    block = packed_linear(x, packed, None)
    for rows in (1, 2, 3, 16):
        assert torch.equal(packed_linear(x[:rows].contiguous(), packed, None), block[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 100])
def test_verify_block_attention_equals_one_row_decode_steps(dtype, window):
    heads, kv_heads, dim, bs, context, q_len = 14, 2, 64, 16, 300, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(q_len, heads, dim, generator=g).to(dtype)
    k = torch.randn(context + q_len, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(context + q_len, kv_heads, dim, generator=g).to(dtype)
    pages = list(range((context + q_len) // bs + 1))
    outs = []
    for one_row_steps in (False, True):
        k_cache = torch.zeros(len(pages), bs, kv_heads, dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        meta = build_metadata([context], [context], [pages], bs)
        paged_attention(q.new_zeros(context, heads, dim), k[:context], v[:context], k_cache, v_cache, meta, 0.125, window)
        if one_row_steps:
            rows = []
            for j in range(q_len):
                meta = build_metadata([context + j + 1], [1], [pages], bs)
                rows.append(paged_attention(q[j : j + 1], k[context + j : context + j + 1], v[context + j : context + j + 1],
                                            k_cache, v_cache, meta, 0.125, window))
            outs.append(torch.cat(rows))
        else:
            meta = build_metadata([context + q_len], [q_len], [pages], bs)
            outs.append(paged_attention(q, k[context:], v[context:], k_cache, v_cache, meta, 0.125, window))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_of_a_verify_block_equal_decode_steps(dtype):
    """The whole target (packed weights, as loaded for inference): K + 1 rows in one forward over a
    300-token context give the logits of K + 1 one-row decode steps, bit for bit."""
    config = tiny_config("qwen2", hidden_size=128, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, num_hidden_layers=2, max_position_embeddings=1024)
    model = build_model(config, dtype=dtype)
    model.init_random_weights_(std=0.05, seed=0)
    bs, context, q_len = 16, 300, 8
    tokens = torch.randint(1, config.vocab_size, (context + q_len,), generator=torch.Generator().manual_seed(2))
    pages = list(range((context + q_len) // bs + 1))
    logits = []
    with torch.inference_mode():
        for one_row_steps in (False, True):
            kv = allocate_kv_caches(config, len(pages), bs, dtype, "cpu")
            model(tokens[:context], torch.arange(context), kv, build_metadata([context], [context], [pages], bs))
            if one_row_steps:
                rows = []
                for p in range(context, context + q_len):
                    h, _ = model(tokens[p : p + 1], torch.tensor([p]), kv, build_metadata([p + 1], [1], [pages], bs))
                    rows.append(model.compute_logits(h))
                logits.append(torch.cat(rows))
            else:
                meta = build_metadata([context + q_len], [q_len], [pages], bs)
                h, _ = model(tokens[context:], torch.arange(context, context + q_len), kv, meta)
                logits.append(model.compute_logits(h))
    assert torch.equal(logits[0], logits[1])
