"""Read an HF-format model folder: config.json, *.safetensors weights, tokenizer.

Weights are read with safetensors only (never torch.load / pickle). Errors name the file and say
how to repair the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from blockdraft.weights.catalog import CATALOG


def _fix_hint(folder: Path) -> str:
    """How to repair `folder`: re-fetch for a catalog model folder, else re-create it."""
    name = folder.name if folder.name in CATALOG else "NAME"
    return f"delete the folder {folder} and re-run `blockdraft fetch {name}` (or re-convert/re-download it)"


def _check_folder(folder: str | os.PathLike) -> Path:
    """`folder` as a Path. Raises ValueError if it is not a directory."""
    path = Path(folder).expanduser().absolute()  # absolute: error messages must say where
    if not path.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist or is not a directory")
    return path


def load_hf_config(folder: str | os.PathLike) -> dict:
    """The parsed config.json of `folder`.

    Raises:
        ValueError: no folder, no config.json, or config.json is not a JSON object.
    """
    path = _check_folder(folder)
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} has no config.json; expected an HF-format model folder ({_fix_hint(path)})")
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is corrupt or truncated ({e}); {_fix_hint(path)}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} holds a {type(cfg).__name__}, expected a JSON object; {_fix_hint(path)}")
    return cfg


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The *.safetensors files of `folder`, sorted by name.

    Raises:
        ValueError: there are none.
    """
    path = _check_folder(folder)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weight files; {_fix_hint(path)}")
    return files


def _read_safetensors(file: Path, folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file (CPU). Raises ValueError if it is corrupt/truncated."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{file} is corrupt or truncated ({e}); {_fix_hint(folder)}") from e


def load_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `folder`, keyed by HF parameter name.

    Tensors keep their stored dtype (bf16 for converted catalog models) and live on the CPU.
    Raises:
        ValueError: no weight files, a corrupt or truncated file, or a name stored twice.
    """
    path = _check_folder(folder)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        part = _read_safetensors(file, path)
        dup = sorted(set(part) & set(state))
        if dup:
            raise ValueError(f"{file} repeats tensors already loaded from another file: {dup[:5]}")
        state.update(part)
    return state


class LazyStateDict(Mapping):
    """The tensors of a folder's *.safetensors files, read one at a time on access.

    For `load_hf_state_dict`, which copies each tensor into the model and drops it: loading then
    holds one tensor beside the model instead of a whole second copy of the weights.
    Raises (at construction): ValueError as `load_state_dict` (no files, corrupt header, a name
    stored twice); on access: ValueError for a tensor that cannot be read, KeyError for a name
    not stored.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        from safetensors import SafetensorError, safe_open

        self._folder = _check_folder(folder)
        self._file_of: dict[str, Path] = {}
        for file in safetensors_files(self._folder):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    names = list(f.keys())
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise ValueError(f"{file} is corrupt or truncated ({e}); {_fix_hint(self._folder)}") from e
            dup = sorted(set(names) & set(self._file_of))
            if dup:
                raise ValueError(f"{file} repeats tensors already loaded from another file: {dup[:5]}")
            self._file_of.update(dict.fromkeys(names, file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        file = self._file_of[name]
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"{file} is corrupt or truncated ({e}); {_fix_hint(self._folder)}") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in `folder` (transformers AutoTokenizer, never remote code).

    Raises:
        ValueError: the folder is missing, or transformers cannot load a tokenizer from it.
    """
    from transformers import AutoTokenizer

    path = _check_folder(folder)
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load a tokenizer from {path} ({e}); {_fix_hint(path)}") from e
