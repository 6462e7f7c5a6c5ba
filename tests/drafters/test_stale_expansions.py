"""Expanding a shipped int8 pack whose files changed removes the copies of the older packs from the
cache, and nothing else: other drafters, expansions in progress, folders or files the expander did
not write. A removal that fails (an old copy in use elsewhere) is skipped silently."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import save_file

import blockdraft.drafters
from blockdraft.drafters import _expand
from blockdraft.drafters.pack import PACK_FILE, pack

NAME = "tiny.drafter"  # the "." must match itself only (qwen2.5-...)


def _shipped(root, version: int):
    """A shipped folder holding an int8 pack; `version` changes config.json, so the hash."""
    folder = root / NAME
    folder.mkdir(parents=True, exist_ok=True)
    save_file(pack({"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}), str(folder / PACK_FILE))
    (folder / "config.json").write_text(json.dumps({"version": version}))
    return folder


def _decoys(drafters):
    """Folders and files next to the copies that cleaning must never touch."""
    made = {
        f"{NAME}-{'a' * 16}": {"model.safetensors": b"x", "notes.txt": b"mine"},  # not only the expander's files
        f"{NAME}-v2-{'b' * 16}": {"model.safetensors": b"x"},  # another drafter's name
        f"{NAME.replace('.', 'x')}-{'b' * 16}": {"model.safetensors": b"x"},  # ditto, "." is no wildcard
        f"other-{'c' * 16}": {"model.safetensors": b"x"},  # another drafter
        f".{NAME}-tmp1234": {"model.safetensors": b"x"},  # an expansion in progress
        f"{NAME}-{'d' * 15}": {"model.safetensors": b"x"},  # not the naming scheme (15 hex digits)
    }
    for name, files in made.items():
        (drafters / name).mkdir(parents=True)
        for f, data in files.items():
            (drafters / name / f).write_bytes(data)
    (drafters / f"{NAME}-{'e' * 16}").write_bytes(b"a file, not a folder")
    target = drafters.parent / "elsewhere"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"keep")
    (drafters / f"{NAME}-{'f' * 16}").symlink_to(target, target_is_directory=True)
    return {*made, f"{NAME}-{'e' * 16}", f"{NAME}-{'f' * 16}"}


def test_a_new_expansion_removes_only_the_older_copies_of_the_same_drafter(tmp_path):
    cache = tmp_path / "cache"
    first = _expand(_shipped(tmp_path / "shipped", 1), cache)
    drafters = first.parent
    decoys = _decoys(drafters)
    assert _expand(_shipped(tmp_path / "shipped", 1), cache) == first  # unchanged files: the same copy
    second = _expand(_shipped(tmp_path / "shipped", 2), cache)
    assert second != first and (second / "model.safetensors").is_file()
    assert not first.exists()
    assert {p.name for p in drafters.iterdir()} == {second.name, *decoys}
    assert (cache / "elsewhere" / "model.safetensors").read_bytes() == b"keep"  # the symlink's target


def test_a_failed_removal_is_skipped_silently(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _expand(_shipped(tmp_path / "shipped", 1), cache)
    real_rmtree = shutil.rmtree
    tried = []

    def rmtree_in_use(path, ignore_errors=False, **kwargs):  # as if another process held the old copy
        if str(path) == str(first):
            tried.append(path)
            if not ignore_errors:
                raise PermissionError(f"in use: {path}")
            return
        real_rmtree(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(blockdraft.drafters.shutil, "rmtree", rmtree_in_use)
    second = _expand(_shipped(tmp_path / "shipped", 2), cache)
    assert (second / "model.safetensors").is_file() and first.exists()
    assert tried == [first]  # the removal was tried, and its failure did not surface


def test_an_unreadable_old_copy_is_skipped_silently(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _expand(_shipped(tmp_path / "shipped", 1), cache)
    real_iterdir = type(first).iterdir
    looked = []

    def iterdir(self):  # the old copy vanishes (another process cleaned it) while we look at it
        if self == first:
            looked.append(self)
            raise FileNotFoundError(self)
        return real_iterdir(self)

    monkeypatch.setattr(type(first), "iterdir", iterdir)
    second = _expand(_shipped(tmp_path / "shipped", 2), cache)
    assert (second / "model.safetensors").is_file() and looked == [first]
