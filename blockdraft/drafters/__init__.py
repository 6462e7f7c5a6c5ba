"""Drafters shipped inside the package, one folder per catalog target name.

A folder holds a z-lab DFlash checkpoint: `config.json` plus either `model.safetensors` (bf16, used
in place) or `model.int8` (8-bit pack, see pack.py), which is expanded once into a bf16 z-lab
folder under `<cache>/drafters/` so the engine always loads the standard format.

    from blockdraft.drafters import shipped_drafter
    LLM(model=name, draft=shipped_drafter(name))   # None when no drafter ships for `name`

A folder may also hold `speculative.json` (the measured default K, see
blockdraft.spec.dflash.checkpoint.recommended_num_speculative_tokens) and `draft_vocab.json`
(the ranked draft vocabulary, see blockdraft.spec.draft_vocab).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent
logger = logging.getLogger(__name__)


AUTO = "auto"  # --draft default: the shipped drafter for the model if one exists, else plain decoding
SHIPPED = "shipped"  # --draft shipped: the shipped drafter for the model, or an error


def shipped_names() -> list[str]:
    """Catalog names that have a shipped drafter."""
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())


def shipped_drafter(model: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """A loadable z-lab drafter folder for catalog model `model`, or None if none ships.

    Only exact catalog names match (a model given as a folder or file path has no shipped drafter).
    bf16 folders are returned in place; an int8 pack is expanded on first use into
    `<cache>/drafters/<model>-<sha256[:16] of the shipped files>/` (written to a temp folder, then
    renamed), next to copies of config.json, speculative.json and draft_vocab.json. Expanding a
    new copy (the shipped files changed) removes the copies of older ones (`_remove_stale_copies`).

    Raises:
        FileNotFoundError: the model's shipped folder has its config.json but no weights file
            (an incomplete install or checkout; names the folder and the files looked for).
    """
    from blockdraft.drafters.pack import PACK_FILE

    if model not in shipped_names():
        return None
    folder = SHIPPED_DIR / model
    if (folder / "model.safetensors").is_file():
        return folder
    if (folder / PACK_FILE).is_file():
        return _expand(folder, cache_dir)
    raise FileNotFoundError(
        f"the shipped drafter for {model!r} in {folder} has its config.json but neither model.safetensors "
        f"nor {PACK_FILE}: the install or checkout is incomplete; reinstall blockdraft, or give --draft PATH "
        "(or --no-draft for plain decoding)"
    )


def check_disable_by_batch_size(value) -> int | None:
    """Raise ValueError naming `speculative_disable_by_batch_size` and `value` unless it is None or
    an int >= 1 (requests; a bool is refused); returns it."""
    from blockdraft.errors import param_error

    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise param_error("speculative_disable_by_batch_size", f"speculative_disable_by_batch_size must be None or "
                          f"an integer >= 1 (requests per step), got {value!r}")
    return value


def check_draft_flags(
    draft: str | None, no_draft: bool, num_speculative_tokens: int | None, draft_vocab_size: int | None = None,
    disable_by_batch_size: int | None = None,
) -> None:
    """Refuse CLI speculative flags that contradict each other or would be silently ignored.

    `draft` None means the default, `auto`.
    Raises:
        ValueError: `--draft PATH | shipped`, `--num-speculative-tokens`, a nonzero
            `--draft-vocab-size` or `--speculative-disable-by-batch-size` with `--no-draft`; the
            latter below 1.
    """
    check_disable_by_batch_size(disable_by_batch_size)
    if no_draft and draft not in (None, AUTO):
        raise ValueError(f"--draft {draft} and --no-draft contradict each other; give one")
    if no_draft and num_speculative_tokens is not None:
        raise ValueError("--num-speculative-tokens needs a drafter; drop --no-draft")
    if no_draft and draft_vocab_size not in (None, 0):
        raise ValueError(f"--draft-vocab-size {draft_vocab_size} needs a drafter; drop --no-draft")
    if no_draft and disable_by_batch_size is not None:
        raise ValueError(f"--speculative-disable-by-batch-size {disable_by_batch_size} needs a drafter; drop --no-draft")


def resolve_draft(
    draft: str | None, model: str, no_draft: bool = False, cache_dir=None, num_speculative_tokens: int | None = None,
    device_type: str = "cpu", draft_vocab_size: int | None = None, notes: list[str] | None = None,
) -> str | None:
    """The CLI's `--draft auto | shipped | PATH` and `--no-draft` -> a drafter folder, or None (plain).

    `auto` (also `draft=None`) picks the drafter shipped for catalog model `model` (a catalog name,
    or the folder `blockdraft fetch` made for one) when one exists and plain decoding otherwise;
    `shipped` insists on it. `auto` also decodes plainly, with a logged warning, when the shipped
    folder's speculative.json says the drafter measured slower than plain on `device_type`
    ("cpu" | "cuda"; checkpoint.draft_auto_off_reason), unless `num_speculative_tokens` or
    `draft_vocab_size` (0 included: the full vocabulary) asks for speculation. `notes`: a list
    that gets that warning instead of the log, for a caller that logs it once its other checks
    pass (LLM), so that a bad argument's error does not come after it.
    Raises:
        ValueError / FileNotFoundError: `shipped` for a model that is neither a catalog name nor an
            existing path (as `resolve_model_path` names it);
        ValueError: `shipped` for a model with no shipped drafter (names the models that have one);
            `num_speculative_tokens` given while `auto` finds no drafter, or outside the shipped
            drafter's [1, block_size - 1].
    """
    if no_draft:
        return None
    if draft not in (None, AUTO, SHIPPED):
        return draft
    from blockdraft.weights.fetch import catalog_name_of

    model = catalog_name_of(model)
    if num_speculative_tokens is not None and model in shipped_names():
        from blockdraft.spec.dflash.checkpoint import read_drafter_config

        # before shipped_drafter, which may expand an int8 pack: a bad K fails without reading weights
        read_drafter_config(SHIPPED_DIR / model).check_num_speculative_tokens(num_speculative_tokens)
    if draft != SHIPPED and num_speculative_tokens is None and draft_vocab_size is None and model in shipped_names():
        from blockdraft.spec.dflash.checkpoint import draft_auto_off_reason

        reason = draft_auto_off_reason(SHIPPED_DIR / model, device_type)
        if reason is not None:  # checked on the shipped folder: no int8 pack is expanded for nothing
            if notes is None:
                logger.warning("%s", reason)
            else:
                notes.append(reason)
            return None
    path = shipped_drafter(model, cache_dir=cache_dir)
    if path is not None:
        return str(path)
    if draft == SHIPPED:
        from blockdraft.weights.fetch import check_model_exists

        check_model_exists(model)  # an unknown name is named as such, not as "no drafter"
        raise ValueError(f"no drafter ships for model {model!r}; shipped drafters: {shipped_names()}")
    if num_speculative_tokens is not None:
        raise ValueError(
            f"--num-speculative-tokens needs a drafter, and none ships for model {model!r} "
            f"(shipped drafters: {shipped_names()}); give --draft PATH"
        )
    return None


def _expand(folder: Path, cache_dir) -> Path:
    """The bf16 z-lab copy of shipped folder `folder`'s int8 pack under `<cache>/drafters/` (made
    on first use; an incomplete copy is rebuilt; once made, copies of older packs are removed).

    Raises:
        ValueError: the pack is damaged (checkpoint.read_weights_file).
    """
    from blockdraft.drafters.pack import PACK_FILE, unpack
    from blockdraft.spec.dflash.checkpoint import SPECULATIVE_FILE, read_weights_file
    from blockdraft.spec.draft_vocab import DRAFT_VOCAB_FILE
    from blockdraft.weights.save import save_safetensors
    from blockdraft.weights.fetch import cache_root

    pack_path = folder / PACK_FILE
    # Every shipped file keys the expanded copy, so a new config or K is never served stale.
    copied = ("config.json", SPECULATIVE_FILE, DRAFT_VOCAB_FILE)
    sidecars = [f for f in copied if (folder / f).is_file()]
    digest = hashlib.sha256()
    for name in [PACK_FILE, *sidecars]:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    digest = digest.hexdigest()[:16]
    dest = cache_root(cache_dir) / "drafters" / f"{folder.name}-{digest}"
    if (dest / "model.safetensors").is_file():
        return dest
    if dest.exists():  # left incomplete (e.g. by hand): rebuilt, or the rename below could never succeed
        shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=dest.parent))
    save_safetensors(unpack(read_weights_file(pack_path)), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in sidecars:
        shutil.copy(folder / name, tmp / name)
    # mkdtemp makes the folder private; the copy is as readable as any other cache file
    tmp.chmod(0o755)
    for file in tmp.iterdir():
        file.chmod(0o644)
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    # a new hash means the shipped files changed: the older copies (~25-40 MB each) would pile up
    _remove_stale_copies(dest, folder.name, {"model.safetensors", *copied})
    return dest


def _remove_stale_copies(dest: Path, drafter: str, files: set[str]) -> None:
    """Delete the other expanded copies of `drafter` next to `dest`: folders named as `_expand`
    names them (`<drafter>-<16 hex digits>`) that hold nothing but files it may write (`files`).

    Anything else is left alone: other drafters, temp folders of an expansion in progress
    (`.<drafter>-*`), symlinks, folders with other contents. Another process may still be using
    an old copy (an older blockdraft sharing the cache): a removal that fails is silently skipped.
    """
    own_name = re.compile(re.escape(drafter) + r"-[0-9a-f]{16}")
    try:
        siblings = list(dest.parent.iterdir())
    except OSError:
        return
    for old in siblings:
        if old.name == dest.name or not own_name.fullmatch(old.name):
            continue
        try:
            if old.is_symlink() or not old.is_dir():
                continue
            if all(f.name in files and f.is_file() and not f.is_symlink() for f in old.iterdir()):
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # gone or unreadable meanwhile (another process): not ours to insist on
            continue
