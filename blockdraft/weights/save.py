"""Write safetensors files with the permissions of any other file the user creates.

`safetensors.torch.save_file` creates its files with mode 0600 whatever the umask, so a drafter,
a converted model or a data shard written by one user could not be read by another (a server
account, a teammate) while its config.json beside it could. `save_safetensors` writes the same
file, then sets the mode `open()` gives a new file (0666 minus the umask), also when it replaced
an older file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file(tensors, path, metadata)`, then mode 0666 & ~umask on `path`.

    tensors: name -> contiguous CPU tensor (any dtype safetensors takes). Raises what save_file
    raises (OSError for an unwritable path, ValueError / SafetensorError for bad tensors); a file
    system that refuses the mode change (some network mounts) only gets a warning: the file is
    written.
    """
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    try:
        os.chmod(path, 0o666 & ~_umask())
    except OSError as e:
        logger.warning("wrote %s but could not set its permissions (%s): it may be readable by its owner only", path, e)


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only be read
    by setting it, which would race with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
