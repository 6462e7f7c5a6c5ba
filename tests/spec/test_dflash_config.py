"""DFlashConfig: parsing of z-lab config.json dicts, every refusal, target cross-checks."""

from __future__ import annotations

import copy

import pytest

from blockdraft.spec.dflash.config import DFlashConfig, build_target_layer_ids
from tests.spec._dflash_util import tiny_target_config

# Shaped like z-lab/Qwen3-4B-DFlash-b16's config.json (block_size at top level, HF 4.x fields).
ZLAB_STYLE = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "transformers_version": "4.57.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def tiny_dict(**top) -> dict:
    """A small valid config dict; keyword args replace top-level keys."""
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": 97,
        "num_target_layers": 8,
        "dflash_config": {"mask_token_id": 96, "target_layer_ids": [1, 5], "block_size": 4},
    }
    d.update(top)
    return d


def with_dflash(**keys) -> dict:
    d = tiny_dict()
    d["dflash_config"] = {**d["dflash_config"], **keys}
    return d


def test_zlab_style_config_parses():
    c = DFlashConfig.from_hf_dict(copy.deepcopy(ZLAB_STYLE))
    assert c.block_size == 16 and c.mask_token_id == 151669
    assert c.target_layer_ids == (1, 9, 17, 25, 33) and c.num_aux_layers == 5
    assert c.num_target_layers == 36 and c.rope_theta == 1e6 and c.rope_scaling is None
    assert c.layer_causal == (False,) * 5 and c.layer_windows == (None,) * 5
    assert c.output_multiplier == 1.0 and c.final_logit_softcapping is None and c.input_embedding_scale == 1.0


def test_dflash_config_block_size_wins_over_top_level():
    d = tiny_dict(block_size=16)
    assert DFlashConfig.from_hf_dict(d).block_size == 4


def test_missing_block_size_defaults_to_16_like_zlab():
    d = tiny_dict()
    del d["dflash_config"]["block_size"]
    assert DFlashConfig.from_hf_dict(d).block_size == 16


def test_hf5_rope_parameters_and_defaults():
    d = tiny_dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del d["rope_theta"], d["head_dim"]
    c = DFlashConfig.from_hf_dict(d)
    assert c.rope_theta == 5e5 and c.head_dim == 128  # HF Qwen3Config's head_dim default
    d = tiny_dict(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert DFlashConfig.from_hf_dict(d).rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "depth,n,expected",
    [(36, 5, (1, 9, 17, 25, 33)), (28, 1, (14,)), (8, 2, (1, 5)), (32, 3, (1, 15, 29)), (4, 2, (1, 1))],
)
def test_default_target_layer_ids(depth, n, expected):
    assert build_target_layer_ids(depth, n) == expected


def test_default_target_layer_ids_used_when_absent():
    d = tiny_dict(num_hidden_layers=3, layer_types=None)
    d["dflash_config"] = {"mask_token_id": 0}
    d["num_target_layers"] = 36
    assert DFlashConfig.from_hf_dict(d).target_layer_ids == (1, 17, 33)
    with pytest.raises(ValueError, match="num_target_layers >= 4"):
        build_target_layer_ids(3, 2)


def test_per_layer_causality_and_window():
    layers = ["full_attention", "sliding_attention"]
    c = DFlashConfig.from_hf_dict(tiny_dict(layer_types=layers, use_sliding_window=True, sliding_window=8))
    assert c.layer_causal == (False, True) and c.layer_windows == (None, 8)
    # HF Qwen3Config (and so z-lab) drops sliding_window without use_sliding_window.
    c = DFlashConfig.from_hf_dict(tiny_dict(layer_types=layers, sliding_window=8))
    assert c.layer_causal == (False, True) and c.layer_windows == (None, None)
    c = DFlashConfig.from_hf_dict(with_dflash(swa_window_size=6) | {"layer_types": layers})
    assert c.layer_windows == (None, 6)
    # Overrides: config.is_causal > dflash_config.causal > layer type.
    c = DFlashConfig.from_hf_dict(with_dflash(causal=True))
    assert c.layer_causal == (True, True)
    d = with_dflash(causal=True)
    d["is_causal"] = False
    assert DFlashConfig.from_hf_dict(d).layer_causal == (False, False)
    # No sliding layer: the window is meaningless and dropped.
    c = DFlashConfig.from_hf_dict(tiny_dict(use_sliding_window=True, sliding_window=8))
    assert c.sliding_window is None


def test_layer_types_default_follows_hf_max_window_layers():
    c = DFlashConfig.from_hf_dict(tiny_dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert c.layer_types == ("full_attention", "sliding_attention")


def test_logit_and_embedding_scales():
    d = with_dflash(output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0)
    c = DFlashConfig.from_hf_dict(d)
    assert (c.output_multiplier, c.final_logit_softcapping, c.input_embedding_scale) == (0.5, 30.0, 2.0)
    assert DFlashConfig.from_hf_dict(with_dflash(final_logit_softcapping=0)).final_logit_softcapping is None
    assert DFlashConfig.from_hf_dict(tiny_dict(output_multiplier=3.0)).output_multiplier == 3.0  # top level


def test_neutral_values_of_optional_keys_are_accepted():
    d = with_dflash(sample_from_anchor=False, use_swa=False, projector_type="dflash", shift_label=False)
    DFlashConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "cfg,key",
    [
        (with_dflash(sample_from_anchor=True), "sample_from_anchor"),
        (tiny_dict(sample_from_anchor=True), "sample_from_anchor"),
        (with_dflash(use_swa=True, swa_window_size=8), "use_swa"),
        (with_dflash(shift_label=True), "shift_label"),
        (with_dflash(projector_type="domino"), "projector_type"),
        (with_dflash(projector_type="dspark"), "projector_type"),
        (with_dflash(conv_kernel_size=4), "conv_kernel_size"),
        (with_dflash(selector_rank=64), "selector_rank"),
        (tiny_dict(selector_top_k=8), "selector_top_k"),
        (with_dflash(emb_dim=32), "emb_dim"),
        (with_dflash(markov_rank=8), "markov_rank"),
        (tiny_dict(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
        (tiny_dict(architectures=["Qwen3ForCausalLM"]), "architectures"),
        (tiny_dict(architectures=None), "architectures"),
        (tiny_dict(model_type="llama"), "model_type"),
        (tiny_dict(attention_bias=True), "attention_bias"),
        (tiny_dict(hidden_act="gelu"), "hidden_act"),
        (tiny_dict(dflash_config={"target_layer_ids": [1, 5]}), "mask_token_id"),
        (with_dflash(mask_token_id=97), "mask_token_id"),
        (with_dflash(target_layer_ids=[1, 1]), "target_layer_ids"),
        (with_dflash(target_layer_ids=[-1, 2]), "target_layer_ids"),
        (with_dflash(target_layer_ids=[1, 8]), "target_layer_ids"),
        (with_dflash(target_layer_ids=[]), "target_layer_ids"),
        (with_dflash(target_layer_ids="1,5"), "target_layer_ids"),
        (with_dflash(block_size=1), "block_size"),
        (tiny_dict(layer_types=["full_attention"]), "layer_types"),
        (tiny_dict(layer_types=["full_attention", "linear_attention"]), "layer_types"),
        (tiny_dict(num_attention_heads=3), "num_key_value_heads"),
        (tiny_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (tiny_dict(is_causal="yes"), "is_causal"),
        (with_dflash(causal=1), "causal"),
        (
            tiny_dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=8)
            | {"is_causal": False},
            "non-causal sliding",
        ),
        (
            with_dflash(swa_window_size=6)
            | {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 8},
            "swa_window_size",
        ),
        (tiny_dict(dflash_config=[1, 2]), "dflash_config"),
    ],
)
def test_refusals_name_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        DFlashConfig.from_hf_dict(cfg)


def test_to_hf_dict_round_trip():
    layers = ["full_attention", "sliding_attention"]
    d = with_dflash(causal=True, output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0)
    d.update(layer_types=layers, use_sliding_window=True, sliding_window=8, num_target_layers=8)
    c = DFlashConfig.from_hf_dict(d)
    out = c.to_hf_dict()
    assert out["architectures"] == ["DFlashDraftModel"] and out["model_type"] == "qwen3"
    assert out["dflash_config"]["block_size"] == 4 and out["block_size"] == 4 and out["is_causal"] is True
    assert DFlashConfig.from_hf_dict(out) == c


def test_validate_against_target():
    c = DFlashConfig.from_hf_dict(tiny_dict())
    c.validate_against_target(tiny_target_config())
    cases = [
        (tiny_target_config(hidden_size=128, head_dim=32), "hidden_size"),
        (tiny_target_config(vocab_size=200), "vocab_size"),
        (tiny_target_config(num_hidden_layers=5), "target_layer_ids"),
        (tiny_target_config(num_hidden_layers=10), "num_target_layers"),
    ]
    for target, key in cases:
        with pytest.raises(ValueError, match=key):
            c.validate_against_target(target)
    # mask id inside the drafter's vocab but past the target's.
    big = DFlashConfig.from_hf_dict(with_dflash(mask_token_id=150) | {"vocab_size": 200})
    with pytest.raises(ValueError, match="mask_token_id"):
        big.validate_against_target(tiny_target_config(vocab_size=200 - 60))
