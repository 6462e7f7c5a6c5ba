"""The drafters shipped in blockdraft/drafters/: size limits, the int8 pack, and loading."""

import json
import shutil

import pytest
import torch

from blockdraft.drafters import SHIPPED_DIR, shipped_drafter, shipped_names
from blockdraft.drafters.pack import PACK_FILE, pack, unpack
from blockdraft.spec.dflash.checkpoint import load_drafter
from tests.conftest import tiny_config

MIB = 1 << 20
LIMITS = {"qwen2.5-coder-0.5b-instruct": 24 * MIB, "smollm2-135m-instruct": 12 * MIB}
# The targets' shapes (ASSETS.md), enough for validate_against_target.
TARGETS = {
    "qwen2.5-coder-0.5b-instruct": dict(arch="qwen2", hidden_size=896, vocab_size=151936, num_hidden_layers=24),
    "smollm2-135m-instruct": dict(arch="llama", hidden_size=576, vocab_size=49152, num_hidden_layers=30),
}


def test_pack_round_trip_is_close_and_keeps_names():
    g = torch.Generator().manual_seed(0)
    state = {"fc.weight": torch.randn(8, 16, generator=g) * 0.05, "norm.weight": torch.rand(8, generator=g) + 0.5}
    packed = pack(state)
    assert packed["fc.weight"].dtype == torch.int8 and packed["fc.weight.scale"].shape == (8,)
    back = unpack(packed)
    assert set(back) == set(state) and all(v.dtype == torch.bfloat16 for v in back.values())
    err = (back["fc.weight"].float() - state["fc.weight"]).abs().max()
    assert err <= state["fc.weight"].abs().max() / 127 * 0.51 + 1e-3  # half a quantization step (+ bf16)
    with pytest.raises(ValueError, match="scale"):
        unpack({"w": packed["fc.weight"]})


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_shipped_drafter_fits_its_budget_and_loads(name, tmp_path):
    assert name in shipped_names()
    folder = SHIPPED_DIR / name
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= LIMITS[name]
    path = shipped_drafter(name, cache_dir=tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 16 and (path / "model.safetensors").is_file()
    target = tiny_config(**TARGETS[name], num_attention_heads=cfg["num_attention_heads"],
                         num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"])
    drafter = load_drafter(path, target, dtype=torch.bfloat16)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    if (folder / PACK_FILE).is_file():  # expanded once into the cache, then reused
        assert shipped_drafter(name, cache_dir=tmp_path) == path and path.is_relative_to(tmp_path)


def test_a_folder_holding_only_the_int8_pack_loads_like_its_expansion(tmp_path):
    """`--draft blockdraft/drafters/<name>` (the pack itself) loads the same weights as the bf16
    folder that `shipped_drafter` expands it into."""
    name = "smollm2-135m-instruct"
    expanded = shipped_drafter(name, cache_dir=tmp_path / "cache")
    cfg = json.loads((expanded / "config.json").read_text())
    target = tiny_config(**TARGETS[name], num_attention_heads=cfg["num_attention_heads"],
                         num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"])
    direct = load_drafter(SHIPPED_DIR / name, target, dtype=torch.bfloat16).state_dict()
    via_cache = load_drafter(expanded, target, dtype=torch.bfloat16).state_dict()
    assert direct.keys() == via_cache.keys() and all(torch.equal(direct[k], via_cache[k]) for k in direct)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((expanded / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.int8"):
        load_drafter(empty, target)


def test_damaged_drafter_weights_are_a_clear_error_and_an_incomplete_copy_is_rebuilt(tmp_path):
    name = "smollm2-135m-instruct"
    broken = tmp_path / "broken"
    shutil.copytree(SHIPPED_DIR / name, broken)
    with open(broken / PACK_FILE, "r+b") as f:  # truncated, as by an interrupted copy
        f.truncate(1000)
    cfg = json.loads((broken / "config.json").read_text())
    target = tiny_config(**TARGETS[name], num_attention_heads=cfg["num_attention_heads"],
                         num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"])
    with pytest.raises(ValueError, match=r"model\.int8.* is damaged"):
        load_drafter(broken, target)
    # A cached copy left without its weights (e.g. deleted by hand) is rebuilt, not served broken.
    cache = tmp_path / "cache"
    path = shipped_drafter(name, cache_dir=cache)
    (path / "model.safetensors").unlink()
    assert shipped_drafter(name, cache_dir=cache) == path and (path / "model.safetensors").is_file()
    assert oct(path.stat().st_mode & 0o777) == "0o755"
