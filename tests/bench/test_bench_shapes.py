"""Shapes: configs of the real architectures, and the weight bytes behind the HBM floor."""

import pytest
import torch

from blockdraft.bench.shapes import (
    SHAPES,
    dflash_extra_bytes,
    get_shape,
    hbm_floor_ms,
    hf_config,
    model_config,
    weight_bytes_per_forward,
)
from blockdraft.config import ModelConfig


@pytest.mark.parametrize(
    "name, total_params",
    [("qwen3-8b", 8_190_735_360), ("qwen2.5-0.5b", 494_032_768)],  # the published checkpoints' counts
)
def test_real_shapes_have_the_published_parameter_counts(name, total_params):
    config = model_config(get_shape(name))
    embed = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    assert weight_bytes_per_forward(config, 1) + embed == total_params


def test_qwen3_8b_shape_and_floor():
    c = model_config(get_shape("qwen3-8b"))
    assert (c.arch, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        "qwen3", 4096, 36, 32, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.rope_theta) == (128, 12288, 151936, 1e6)
    assert c.qk_norm and not c.tie_word_embeddings and not c.attention_bias
    # 7.57e9 bf16 weights read per step / 4.25e12 B/s
    assert hbm_floor_ms(weight_bytes_per_forward(c, 2)) == pytest.approx(3.5616, abs=1e-4)


def test_qwen25_05b_shape():
    c = model_config(get_shape("qwen2.5-0.5b"))
    assert (c.arch, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        "qwen2", 896, 24, 14, 2)
    assert c.head_dim == 64 and c.intermediate_size == 4864 and c.attention_bias and c.tie_word_embeddings


@pytest.mark.parametrize("model_type, tied", [("qwen3", False), ("qwen2", True), ("qwen2", False), ("llama", True)])
def test_weight_bytes_count_every_parameter_a_decode_step_reads(model_type, tied):
    """Against the parameters of an actual transformers model: all of them, minus the input
    embedding when the head is a separate matrix."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_config(cfg)
    params = dict(hf.named_parameters())  # a tied head is listed once
    read = sum(p.numel() for n, p in params.items() if tied or n != "model.embed_tokens.weight")
    ours = ModelConfig.from_hf_dict(cfg.to_dict())
    assert weight_bytes_per_forward(ours, 2) == 2 * read


def test_dflash_extra_bytes_add_the_lm_head_once_more():
    c = model_config(get_shape("tiny"))
    assert dflash_extra_bytes(1000, c, 2) == 2 * (1000 + c.vocab_size * c.hidden_size)


def test_every_shape_builds_an_hf_config():
    for shape in SHAPES.values():
        assert hf_config(shape).model_type == shape.model_type


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown shape 'qwen9'.*qwen3-8b"):
        get_shape("qwen9")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        hbm_floor_ms(10, 0.0)
    assert torch.bfloat16.itemsize == 2  # floor_of uses dtype.itemsize


def test_a_shape_too_big_for_host_memory_is_refused_before_building(monkeypatch):
    import torch

    from blockdraft.bench import workload

    pages = {"SC_PHYS_PAGES": 2**20, "SC_PAGE_SIZE": 4096}  # a 4 GiB machine
    monkeypatch.setattr(workload.os, "sysconf", lambda name: pages[name])
    with pytest.raises(ValueError, match=r"qwen3-8b shape needs ~33 GB of float32 weights in host memory, and this "
                                         r"machine has 4 GB: on the CPU use a smaller --shape"):
        workload.random_workload("qwen3-8b", torch.device("cpu"), torch.float32, num_prompts=1, prompt_len=4,
                                 draft_layers=None, block_size=4)
    workload.check_fits_in_memory(get_shape("qwen2.5-0.5b"), torch.float32)  # ~2.5 GB: fits in 80 % of 4 GiB
    pages["SC_PHYS_PAGES"] = 2**19  # 2 GiB
    workload.check_fits_in_memory(get_shape("qwen2.5-0.5b"), torch.bfloat16)  # ~1.2 GB: fits
    with pytest.raises(ValueError, match=r"qwen2.5-0.5b shape needs ~\d GB of float32 .* machine has 2 GB"):
        workload.check_fits_in_memory(get_shape("qwen2.5-0.5b"), torch.float32)
