"""Saved safetensors files get the mode any file the user creates gets (safetensors alone makes 0600)."""

import os
import stat

import torch

from blockdraft.spec.dflash.checkpoint import export_drafter, load_drafter, random_drafter
from blockdraft.weights.save import save_safetensors
from tests.conftest import tiny_config


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_saved_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "shared.safetensors")
        os.umask(0o077)
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "private.safetensors")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "shared.safetensors") == 0o644  # safetensors' own save_file: 0600
    assert _mode(tmp_path / "private.safetensors") == 0o600


def test_a_refused_mode_change_is_a_warning_not_a_failed_save(tmp_path, monkeypatch, caplog):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", refuse)
    save_safetensors({"a": torch.ones(2)}, tmp_path / "w.safetensors")
    assert "could not set its permissions" in caplog.text
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w.safetensors")["a"], torch.ones(2))


def test_an_exported_drafter_is_readable_like_its_config(tmp_path):
    target = tiny_config("qwen3")
    drafter = random_drafter(target, num_layers=1, block_size=4, target_layer_ids=(0,), seed=0)
    old = os.umask(0o022)
    try:
        export_drafter(drafter, tmp_path / "d")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "d" / "model.safetensors") == _mode(tmp_path / "d" / "config.json") == 0o644
    assert load_drafter(tmp_path / "d", target).config.block_size == 4
