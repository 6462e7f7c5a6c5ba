"""Checkpoint io: our export -> our load (bitwise), our export -> z-lab's class, z-lab's files -> ours."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from blockdraft.spec.dflash import DFlashSpeculator, export_drafter, load_drafter, random_drafter
from tests.spec._dflash_util import (
    TinyTarget,
    shuffled_block_table,
    slots_for,
    tiny_target_config,
    zlab_draft_logits,
)

KV_BLOCK_SIZE = 4


def _drafter(**kw):
    kw.setdefault("init_std", 0.25)
    return random_drafter(tiny_target_config(), num_layers=2, block_size=5, seed=3, **kw)


def _our_logits(drafter, target, features: torch.Tensor, bonus: int, k: int) -> torch.Tensor:
    """[K, V] logits of one request with context `features` at positions 0..P-1."""
    table = shuffled_block_table(1, 8)
    spec = DFlashSpeculator(drafter, target, k, num_kv_blocks=8, kv_block_size=KV_BLOCK_SIZE)
    pos = torch.arange(features.shape[0])
    spec.propose(features, pos, slots_for(table[0], pos, KV_BLOCK_SIZE), torch.tensor([bonus]), pos[-1:] + 1, table)
    return spec.draft_logits(torch.tensor([bonus]), pos[-1:] + 1, table)[0]


def test_export_load_round_trip_is_bitwise_in_bf16(tmp_path):
    model = _drafter(dtype=torch.bfloat16, layer_types=("full_attention", "sliding_attention"), sliding_window=6,
                     output_multiplier=0.5)
    export_drafter(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(tmp_path, tiny_target_config(), dtype=torch.bfloat16)
    assert loaded.config == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert theirs[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs[name]), name
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32  # the bf16 cast must not degrade RoPE


def test_exported_checkpoint_loads_in_zlab_class(tmp_path):
    ZLab = pytest.importorskip("dflash.model", reason="z-lab dflash==0.1.0 not installed").DFlashDraftModel

    model = _drafter(layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    export_drafter(model, tmp_path)
    zl, info = ZLab.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert zl.block_size == 5 and zl.mask_token_id == model.config.mask_token_id
    assert list(zl.target_layer_ids) == list(model.config.target_layer_ids)
    assert (zl.layers[0].self_attn.is_causal, zl.layers[0].self_attn.sliding_window) == (True, 6)
    ours = load_drafter(tmp_path, tiny_target_config(), dtype=torch.float32)  # same bf16-rounded weights
    target = TinyTarget(tiny_target_config())
    features = torch.randn(11, model.config.num_aux_layers * 64, generator=torch.Generator().manual_seed(0))
    ref = zlab_draft_logits(zl.eval(), target, features, bonus=7, num_query=5)
    torch.testing.assert_close(_our_logits(ours, target, features, 7, 4), ref, atol=1e-4, rtol=1e-4)


def _zlab_style_config(model) -> dict:
    """A tiny config in the shape of z-lab's released files: block_size at top level only,
    auto_map, HF 4.x rope fields, tied embeddings flag, no dflash_config.block_size."""
    c = model.config
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 5,
        "bos_token_id": 1,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "max_position_embeddings": 512,
        "max_window_layers": c.num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "num_target_layers": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": c.vocab_size,
    }


def test_zlab_style_checkpoint_loads_in_ours(tmp_path):
    model = _drafter()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_zlab_style_config(model)))
    loaded = load_drafter(tmp_path, tiny_target_config(), dtype=torch.float32)
    assert loaded.config.block_size == 5 and loaded.config == model.config
    target = TinyTarget(tiny_target_config())
    features = torch.randn(9, model.config.num_aux_layers * 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_our_logits(loaded, target, features, 3, 4), _our_logits(model, target, features, 3, 4))


def test_zlab_saved_checkpoint_loads_in_ours(tmp_path):
    """Files written by z-lab's own save_pretrained (HF 5 config format, rope_parameters) load in ours."""
    ZLab = pytest.importorskip("dflash.model", reason="z-lab dflash==0.1.0 not installed").DFlashDraftModel
    from transformers import Qwen3Config

    model = _drafter()
    zl = ZLab(Qwen3Config.from_dict(_zlab_style_config(model))).float().eval()
    zl.load_state_dict(model.state_dict(), strict=True)
    zl.save_pretrained(str(tmp_path))
    loaded = load_drafter(tmp_path, tiny_target_config(), dtype=torch.float32)
    target = TinyTarget(tiny_target_config())
    features = torch.randn(10, model.config.num_aux_layers * 64, generator=torch.Generator().manual_seed(2))
    ref = zlab_draft_logits(zl, target, features, bonus=4, num_query=5)
    torch.testing.assert_close(_our_logits(loaded, target, features, 4, 4), ref, atol=1e-4, rtol=1e-4)


def test_load_refusals(tmp_path):
    target_cfg = tiny_target_config()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path, target_cfg)
    model = _drafter()
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_drafter(tmp_path, target_cfg)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    weights.pop("fc.weight")
    weights["lm_head.weight"] = torch.zeros(3, 3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing keys \['fc.weight'\].*unexpected keys \['lm_head.weight'\]") as e:
        load_drafter(tmp_path, target_cfg)
    # which drafter: the weight file and its config.json are named (the message alone did not say)
    assert str(e.value).startswith(f"{tmp_path / 'model.safetensors'}: DFlash drafter weights do not match the config")
    assert str(e.value).endswith(f"({tmp_path / 'config.json'})")
    with pytest.raises(ValueError, match="hidden_size"):
        load_drafter(tmp_path, tiny_target_config(hidden_size=128, head_dim=32))


def test_load_weights_reports_shape_mismatch():
    model = _drafter()
    sd = dict(model.state_dict())
    sd["norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="norm.weight: checkpoint \\(3,\\)"):
        model.load_weights(sd)


def test_a_config_without_dflash_config_is_named_as_such(tmp_path):
    """Was `dflash_config.mask_token_id must be an integer, got None`: a value of a block the file lacks.
    Said so only of a config.json that is no DFlash drafter's at all (no dflash_config, DFlash
    architecture or top-level DFlash keys); an older drafter config with its DFlash values at the top
    level, which still loads, keeps its value's error, the missing block said after it."""
    from blockdraft.spec.dflash.checkpoint import read_drafter_config

    model = _drafter()
    export_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dflash_config"]
    for key in ("block_size", "num_target_layers"):
        config.pop(key, None)
    config["architectures"] = ["Qwen3ForCausalLM"]  # a target's config: why is said after it
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = f"{tmp_path / 'config.json'} has no dflash_config (not a DFlash drafter checkpoint?)"
    with pytest.raises(ValueError) as e:
        load_drafter(tmp_path, tiny_target_config())
    assert str(e.value) == f"{message}: architectures ['Qwen3ForCausalLM'] is not a DFlash drafter; expected " \
                           f"['DFlashDraftModel']"
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        read_drafter_config(tmp_path)
    assert str(e.value) == f"{message}: architectures [] is not a DFlash drafter; expected ['DFlashDraftModel']"

    # older files with the DFlash values at the top level and no dflash_config block still load
    legacy = {**model.config.to_hf_dict(), "architectures": ["DFlashDraftModel"]}
    legacy.update(legacy.pop("dflash_config"))
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert read_drafter_config(tmp_path) == model.config
    # ... and a bad value in one is named as such (it was "has no dflash_config", the value dropped)
    block = f" ({tmp_path / 'config.json'} has no dflash_config block: its DFlash values are read from the top " \
            f"level, as in older drafter configs)"
    for changes, detail in (({"mask_token_id": "x"}, "dflash_config.mask_token_id must be an integer, got 'x'"),
                            ({"mask_token_id": None}, "dflash_config.mask_token_id must be an integer, got None"),
                            ({"target_layer_ids": "1,2"},
                             "dflash_config.target_layer_ids must be a list of integers, got '1,2'")):
        (tmp_path / "config.json").write_text(json.dumps({**legacy, **changes}))
        with pytest.raises(ValueError) as e:
            read_drafter_config(tmp_path)
        assert str(e.value) == f"drafter {tmp_path}: {detail}{block}"
    # a DFlash architecture without any DFlash value: its missing value, not "not a DFlash drafter"
    bare = {k: v for k, v in legacy.items() if k not in ("mask_token_id", "target_layer_ids", "block_size")}
    (tmp_path / "config.json").write_text(json.dumps(bare))
    with pytest.raises(ValueError) as e:
        read_drafter_config(tmp_path)
    assert str(e.value) == f"drafter {tmp_path}: dflash_config.mask_token_id must be an integer, got None{block}"
