"""A folder of files replaced as one: the trainer's checkpoint (weights, optimizer state, state.json).

Each file renamed into place on its own is atomic, the set is not: an interruption (a second
Ctrl-C, a crash, a lent machine taken back) between two files would leave weights of one step
beside a state.json of another, and a resume would mix them. So the new set is written into
`<name>.new/` beside the folder, fsynced, and swapped in with two renames:

    <name>/ -> <name>.old/,  <name>.new/ -> <name>/,  then <name>.old/ is removed.

A folder is complete when its marker file (written last, after the others are fsynced) is there.
Wherever an interruption falls, one complete folder is left: `current_folder` finds it without
touching anything, `settle_folder` renames it back to `<name>/` and removes the leftovers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

NEW, OLD = ".new", ".old"  # suffixes of the folder being written and of the one being replaced


def write_synced(path: Path, write: Callable[[Path], None]) -> int:
    """write(path), then fsync the file, so that a file written after it (the marker) never
    reaches the disk before it. Returns the file's size in bytes."""
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return path.stat().st_size


def current_folder(folder: Path, marker: str) -> Path | None:
    """The complete copy of `folder` (one holding `marker`), without changing anything: `folder`
    itself whenever it exists (None if it lacks the marker: never completed), else `<folder>.new`
    (an interruption between the two renames of `replace_folder`: complete, the newer) or
    `<folder>.old`, else None."""
    folder = Path(folder)
    if folder.exists():
        return folder if (folder / marker).is_file() else None
    for other in (_beside(folder, NEW), _beside(folder, OLD)):
        if (other / marker).is_file():
            return other
    return None


def settle_folder(folder: Path, marker: str) -> Path | None:
    """Finish an interrupted `replace_folder`: the complete copy (`current_folder`) is renamed to
    `folder`, and `<folder>.new` / `<folder>.old` left over are removed. Returns `folder`, or None
    when no complete copy exists (then only the leftovers are removed)."""
    folder = Path(folder)
    found = current_folder(folder, marker)
    if found is not None and found != folder:
        _rename(found, folder)
        _fsync_dir(folder.parent)
    for other in (_beside(folder, NEW), _beside(folder, OLD)):
        if other.exists():
            shutil.rmtree(other)
    return folder if found is not None else None


def replace_folder(folder: Path, fill: Callable[[Path], None], marker: str) -> Path:
    """Replace `folder` by what `fill(new)` writes into an empty folder `new`, all or nothing.

    `fill` writes every file with `write_synced` and `marker` last. An interruption anywhere
    leaves one complete folder, the old one or the new one (`current_folder`, `settle_folder`).

    Raises:
        ValueError: `fill` wrote no `marker` (a bug: the new folder could never be recognised
            as complete); the folder in place is left as it was.
    """
    folder = Path(folder)
    settle_folder(folder, marker)  # a copy an earlier interruption left under .new/.old is the one in place now
    new, old = _beside(folder, NEW), _beside(folder, OLD)
    new.mkdir(parents=True)
    fill(new)
    if not (new / marker).is_file():
        raise ValueError(f"{new} holds no {marker} after writing: not swapped in")
    _fsync_dir(new)
    if folder.exists():
        _rename(folder, old)
    _rename(new, folder)
    _fsync_dir(folder.parent)
    if old.exists():
        shutil.rmtree(old)
    return folder


def _beside(folder: Path, suffix: str) -> Path:
    return folder.with_name(folder.name + suffix)


def _rename(src: Path, dst: Path) -> None:
    """One rename (tests interrupt the swap here)."""
    os.rename(src, dst)


def _fsync_dir(path: Path) -> None:
    """Make the renames and new entries in the folder `path` durable (POSIX; elsewhere a no-op:
    Windows cannot open a folder to fsync it)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
