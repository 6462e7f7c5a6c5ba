"""`--threads`: the CPU threads of torch's math, one flag for every command that runs a model
(the `blockdraft` commands and the `python -m blockdraft.bench.*` scripts)."""

from __future__ import annotations

import argparse


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """`--threads N` on a parser that runs a model (every `blockdraft` command but fetch, and the
    `python -m blockdraft.bench.*` scripts); apply it with `set_threads`."""
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for the model's math (default: torch's, one per core); on a machine "
             "shared with other jobs 1 can be much faster than oversubscribed cores")


def set_threads(threads: int | None) -> None:
    """Apply --threads (torch.set_num_threads) before any model work; None leaves torch's default.

    Raises:
        ValueError: threads < 1.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def apply_threads_flag(parser: argparse.ArgumentParser, threads: int | None) -> None:
    """`set_threads` for a script's own parser: a bad value is `parser.error` (one usage line,
    exit 2), as the `blockdraft` commands report it."""
    try:
        set_threads(threads)
    except ValueError as e:
        parser.error(str(e))
