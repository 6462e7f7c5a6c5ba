"""GGUF -> HF conversion pieces that need no real model: names and the q/k un-permute."""

from __future__ import annotations

import numpy as np
import pytest

from blockdraft.weights.convert import hf_tensor_name, unpermute_qk


@pytest.mark.parametrize(
    "gguf_name, hf_name",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
        ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.3.attn_k_norm.weight", "model.layers.3.self_attn.k_norm.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
        ("rope_freqs.weight", None),
        ("blk.x.attn_q.weight", None),
        ("blk.1.ffn_gate_exps.weight", None),
    ],
)
def test_hf_tensor_name(gguf_name, hf_name):
    assert hf_tensor_name(gguf_name) == hf_name


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, head_dim, cols", [(9, 64, 576), (3, 64, 576), (2, 8, 0)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)
