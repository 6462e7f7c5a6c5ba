"""Reading HF folders: safetensors only, clear errors for missing, corrupt and truncated files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from blockdraft.weights.loader import LazyStateDict, load_hf_config, load_state_dict, load_tokenizer

# Both readers: the whole dict at once, and the lazy one (materialised here so every tensor is read).
READERS = [load_state_dict, lambda folder: dict(LazyStateDict(folder))]


def make_folder(path, shards=2):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 2}))
    tensors = {}
    for i in range(shards):
        part = {f"model.layers.{i}.w": torch.randn(4, 3), f"model.layers.{i}.b": torch.arange(3, dtype=torch.bfloat16)}
        save_file(part, str(path / f"model-{i:05d}.safetensors"))
        tensors.update(part)
    return tensors


@pytest.mark.parametrize("read", READERS, ids=["eager", "lazy"])
def test_load_state_dict_reads_all_shards(tmp_path, read):
    expected = make_folder(tmp_path / "m")
    state = read(tmp_path / "m")
    assert set(state) == set(expected)
    for k, v in expected.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v)


def test_load_hf_config(tmp_path):
    make_folder(tmp_path / "m")
    assert load_hf_config(tmp_path / "m")["eos_token_id"] == 2


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf_config(tmp_path / "m")


@pytest.mark.parametrize("read", READERS, ids=["eager", "lazy"])
def test_missing_folder(tmp_path, read):
    with pytest.raises(ValueError, match="does not exist"):
        read(tmp_path / "absent")


def test_corrupt_config(tmp_path):
    make_folder(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"architectures": [')
    with pytest.raises(ValueError, match="config.json is corrupt or truncated"):
        load_hf_config(tmp_path / "m")


@pytest.mark.parametrize("read", READERS, ids=["eager", "lazy"])
def test_no_safetensors(tmp_path, read):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"pickles are never read")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        read(folder)


@pytest.mark.parametrize("read", READERS, ids=["eager", "lazy"])
def test_corrupt_safetensors(tmp_path, read):
    folder = tmp_path / "smollm2-135m-instruct"
    make_folder(folder)
    bad = folder / "model-00001.safetensors"
    bad.write_bytes(b"\x00garbage that is no safetensors header" * 4)
    with pytest.raises(ValueError) as info:
        read(folder)
    msg = str(info.value)
    assert str(bad) in msg and "corrupt or truncated" in msg
    assert "blockdraft fetch smollm2-135m-instruct" in msg and "delete the folder" in msg


@pytest.mark.parametrize("read", READERS, ids=["eager", "lazy"])
def test_truncated_safetensors(tmp_path, read):
    folder = tmp_path / "m"
    make_folder(folder)
    file = folder / "model-00000.safetensors"
    file.write_bytes(file.read_bytes()[:-7])
    with pytest.raises(ValueError, match="model-00000.safetensors is corrupt or truncated"):
        read(folder)


@pytest.mark.parametrize("read", READERS, ids=["eager", "lazy"])
def test_duplicate_tensor_across_shards(tmp_path, read):
    folder = tmp_path / "m"
    make_folder(folder, shards=1)
    save_file({"model.layers.0.w": torch.zeros(1)}, str(folder / "model-extra.safetensors"))
    with pytest.raises(ValueError, match="repeats tensors"):
        read(folder)


def test_load_tokenizer_missing_files(tmp_path):
    make_folder(tmp_path / "m")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "m")


def test_lazy_state_dict_reads_on_access(tmp_path):
    expected = make_folder(tmp_path / "m")
    lazy = LazyStateDict(tmp_path / "m")
    assert len(lazy) == len(expected) and set(lazy) == set(expected) and "model.layers.0.w" in lazy
    assert torch.equal(lazy["model.layers.1.w"], expected["model.layers.1.w"])
    with pytest.raises(KeyError):
        lazy["model.layers.9.w"]
