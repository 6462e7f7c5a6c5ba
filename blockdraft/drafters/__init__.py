"""Drafters shipped inside the package, one folder per catalog target name.

A folder holds a z-lab DFlash checkpoint: `config.json` plus either `model.safetensors` (bf16, used
in place) or `model.int8` (8-bit pack, see pack.py), which is expanded once into a bf16 z-lab
folder under `<cache>/drafters/` so the engine always loads the standard format.

    from blockdraft.drafters import shipped_drafter
    LLM(model=name, draft=shipped_drafter(name))   # None when no drafter ships for `name`
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent


def shipped_names() -> list[str]:
    """Catalog names that have a shipped drafter."""
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())


def shipped_drafter(model: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """A loadable z-lab drafter folder for catalog model `model`, or None if none ships.

    bf16 folders are returned in place; an int8 pack is expanded on first use into
    `<cache>/drafters/<model>-<sha256[:16] of the pack>/` (written to a temp folder, then renamed).
    """
    from blockdraft.drafters.pack import PACK_FILE

    folder = SHIPPED_DIR / model
    if not (folder / "config.json").is_file():
        return None
    if (folder / "model.safetensors").is_file():
        return folder
    if (folder / PACK_FILE).is_file():
        return _expand(folder, cache_dir)
    return None


def check_draft_flags(draft: str | None, no_draft: bool, num_speculative_tokens: int | None) -> None:
    """Refuse CLI speculative flags that would otherwise be silently ignored.

    Raises:
        ValueError: `--draft` with `--no-draft`, or `--num-speculative-tokens` without a drafter.
    """
    if no_draft and draft is not None:
        raise ValueError(f"--draft {draft} and --no-draft contradict each other; give one")
    if num_speculative_tokens is not None and (draft is None or no_draft):
        raise ValueError("--num-speculative-tokens needs --draft PATH or --draft shipped")


def resolve_draft(draft: str | None, model: str, no_draft: bool = False, cache_dir=None) -> str | None:
    """The CLI's `--draft PATH | shipped` and `--no-draft` -> a drafter folder, or None (plain decoding).

    Raises:
        ValueError: `shipped` for a model with no shipped drafter (names the models that have one).
    """
    if no_draft or draft is None:
        return None
    if draft != "shipped":
        return draft
    path = shipped_drafter(model, cache_dir=cache_dir)
    if path is None:
        raise ValueError(f"no drafter ships for model {model!r}; shipped drafters: {shipped_names()}")
    return str(path)


def _expand(folder: Path, cache_dir) -> Path:
    from safetensors.torch import load_file, save_file

    from blockdraft.drafters.pack import PACK_FILE, unpack
    from blockdraft.weights.fetch import cache_root

    pack_path = folder / PACK_FILE
    digest = hashlib.sha256(pack_path.read_bytes()).hexdigest()[:16]
    dest = cache_root(cache_dir) / "drafters" / f"{folder.name}-{digest}"
    if (dest / "model.safetensors").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=dest.parent))
    save_file(unpack(load_file(str(pack_path))), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp / "config.json")
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
