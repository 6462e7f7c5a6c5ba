"""`--threads`: the CPU threads of torch's math, one flag for every command that runs a model
(the `blockdraft` commands and the `python -m blockdraft.bench.*` scripts).

Without the flag (or $BLOCKDRAFT_THREADS) a command whose model runs on the CPU takes torch's
default (one thread per core) unless other processes keep cores busy: then only the cores left
free (GPU commands keep torch's default). torch's threads wait for each
other at every op, so a thread whose core another job holds stalls all of them: on a 2-core
machine with another job running, the README's demo took 16 min with 2 threads and 53 s with 1
(session 16's new-user trial, docs/benchmarks/cpu.md).

The Python API chooses the same way: `LLM(threads=...)` (`engine_threads`). A command chooses
once, before its first model is built (`command_threads`), and the engines it builds keep that
choice; the automatic choice waits until the flags are checked, so a bad flag gets its error
without the thread notice (or the 0.1 s load sample) before it.
"""

from __future__ import annotations

import argparse
import contextlib
import numbers
import os
import sys
import time
from typing import Callable, Iterator

THREADS_ENV = "BLOCKDRAFT_THREADS"  # the default of --threads, e.g. for scripts and tests
BUSY_SAMPLE_S = 0.1  # how long /proc/stat is watched before choosing (seconds)

# Process-wide state. _chosen: a thread count was applied in this process (a flag, the variable,
# LLM(threads=N) or the automatic choice, which samples the load): later engines keep it, not
# choosing again. _auto_pending: a command's automatic choice, made by the first model build
# (apply_pending_threads). _torch_default: torch's thread count when blockdraft first looked
# (remember_torch_default), taken as torch's default: another count was set by the user.
_chosen = False
_auto_pending = False
_torch_default: int | None = None


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """`--threads N` on a parser that runs a model (every `blockdraft` command but fetch, and the
    `python -m blockdraft.bench.*` scripts); apply it with `set_threads`."""
    parser.add_argument(
        "--threads", type=int, default=None,
        help=f"CPU threads for the model's math (default: ${THREADS_ENV}, else one per core, minus the "
             "cores other processes keep busy when the command starts: oversubscribed cores stall torch)")


def set_threads(threads: int | None, auto: bool = True) -> None:
    """Apply --threads (torch.set_num_threads) before any model work. None: $BLOCKDRAFT_THREADS,
    else, with `auto`, `auto_threads` of what /proc/stat shows for BUSY_SAMPLE_S seconds, now
    (a line on stderr says so when it takes fewer than torch's default), else torch's default
    (commands whose model runs on a GPU: the CPU only feeds it). A given count above the cores this
    process may use is applied as asked, with a line on stderr saying it is slower.

    Raises:
        ValueError: threads < 1, or $BLOCKDRAFT_THREADS not an integer >= 1.
    """
    import torch

    global _chosen
    if threads is None:
        threads = env_threads()
    if threads is None and not auto:
        return
    if threads is None:
        _chosen = True  # the load was sampled once: later engines keep what it gave
        default = torch.get_num_threads()
        cpus, available = _available_cpus()
        available = available or default
        busy = busy_cpus(available, cpus=cpus)
        chosen = auto_threads(default, available, busy)
        if chosen < default:
            print(f"blockdraft: {chosen} CPU thread{'s' * (chosen > 1)} for the model's math, not {default}: "
                  f"{available} core{'s' * (available > 1)} available to this process, other processes keep "
                  f"about {busy:.1f} of them busy (--threads N, LLM(threads=N) or ${THREADS_ENV} sets it)",
                  file=sys.stderr, flush=True)  # fmt: skip
            torch.set_num_threads(chosen)
        return
    if threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {threads}")
    _, available = _available_cpus()
    if available is not None and threads > available:  # the user's count is kept, but said to cost
        print(f"blockdraft: {threads} CPU threads asked for, more than the {available} core{'s' * (available > 1)} "
              f"available to this process: the threads take turns on the cores, which stalls torch's math "
              f"(--threads {available} or fewer is faster)", file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    _chosen = True


def _available_cpus() -> tuple[list[int] | None, int | None]:
    """The cores this process may run on: their ids (its affinity mask; None where the OS has none)
    and their count (else os.cpu_count(); None if unknown)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return cpus or None, len(cpus) if cpus else os.cpu_count()


def env_threads() -> int | None:
    """$BLOCKDRAFT_THREADS as an integer, None when unset or empty.

    Raises:
        ValueError: set to anything but an integer >= 1 (names the value).
    """
    value = os.environ.get(THREADS_ENV)
    if not value:
        return None
    if not value.strip().isdecimal() or not value.strip().isascii() or int(value) < 1:
        raise ValueError(f"${THREADS_ENV} must be an integer >= 1 (CPU threads), got {value!r}")
    return int(value)


@contextlib.contextmanager
def command_threads(threads: int | None, auto: bool = True) -> Iterator[None]:
    """`set_threads` for a `blockdraft` command, around its body: --threads N or
    $BLOCKDRAFT_THREADS is checked and applied now; the automatic choice (`auto`: the model runs
    on the CPU) waits for the command's first model build (`apply_pending_threads`), after the
    command has checked its other flags, so that a bad flag is reported without the thread notice
    before it. A choice not made by the end of the body is dropped.

    Raises:
        ValueError: threads < 1, or $BLOCKDRAFT_THREADS not an integer >= 1 (before the body runs).
    """
    global _auto_pending, _chosen
    if threads is not None or os.environ.get(THREADS_ENV) or not auto:
        set_threads(threads, auto=False)
        _chosen = True  # also on a GPU without a flag (torch's default): the command's engines keep it
        yield
        return
    _auto_pending = True
    try:
        yield
    finally:
        _auto_pending = False


def apply_pending_threads() -> None:
    """Make a command's deferred automatic choice (`command_threads`), once; called where model
    work starts (models.build_model, LLM before its weights load). Nothing otherwise."""
    global _auto_pending
    if _auto_pending:
        _auto_pending = False
        set_threads(None)


def remember_torch_default() -> int:
    """torch's CPU thread count the first time this is called (at `import blockdraft.llm`), which
    `engine_threads` takes as torch's default: a count other than this one was set by the user
    (torch.set_num_threads), and is kept."""
    global _torch_default
    if _torch_default is None:
        import torch

        _torch_default = torch.get_num_threads()
    return _torch_default


def check_threads(threads) -> None:
    """Check `LLM(threads=...)`: None or an integer >= 1 (CPU threads; a numpy integer is one).

    Raises:
        ValueError: anything else (a bool, a float, 0, -1), naming the value.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral)
                                or threads < 1):  # numpy integers too, as SamplingParams takes them
        from blockdraft.errors import param_error

        raise param_error("threads", f"threads must be None or an integer >= 1 (CPU threads), got {threads!r}")


def engine_threads(threads: int | None, device: str) -> None:
    """`LLM(threads=...)`, applied once the engine's settings are checked, before its weights load.

    threads: torch's CPU threads (an integer >= 1), applied whatever the device (a GPU engine's
    host work runs on them too). None: a command's pending choice if any (`command_threads`);
    else nothing when this process already chose (a command's flag, an earlier engine: they share
    torch's one setting) or when torch's count is no longer its default (the user set it: kept;
    $BLOCKDRAFT_THREADS is then only checked); else $BLOCKDRAFT_THREADS, else on `device`
    ("cpu" | "cuda") "cpu" the automatic choice (`set_threads`, which may say so on stderr), on a
    GPU torch's default.

    Raises:
        ValueError: threads not None or an integer >= 1 (check_threads, naming the value), or
            $BLOCKDRAFT_THREADS not an integer >= 1.
    """
    global _auto_pending
    check_threads(threads)
    if threads is not None:
        _auto_pending = False  # the engine's own count: no load sample for a choice it replaces
        set_threads(int(threads))
        return
    apply_pending_threads()
    import torch

    if _chosen or torch.get_num_threads() != remember_torch_default():
        env_threads()  # not applied (a count was chosen before), still checked: a typo is not silent
        return
    set_threads(None, auto=device == "cpu")


def auto_threads(default: int, available: int, busy: float | None) -> int:
    """Threads for torch's math: `default` (torch's own choice) unless `busy` of the `available`
    cores are taken by other processes, then the free ones (rounded), at least 1, at most
    `default`; `default` when `busy` is unknown (None)."""
    if busy is None:
        return default
    return max(1, min(default, int(available - busy + 0.5)))  # half a core free counts as one


def _read_cpu_times(cpus: list[int] | None = None) -> tuple[int, int]:
    """(idle, total) jiffies since boot of the CPUs `cpus` (the per-CPU `cpuN` lines of
    /proc/stat, Linux), or of all CPUs (its first line) when None or when a line is missing."""
    with open("/proc/stat") as f:
        lines = [line.split() for line in f if line.startswith("cpu")]
    rows = [lines[0][1:]]
    if cpus:
        per_cpu = {row[0]: row[1:] for row in lines[1:]}
        if all(f"cpu{c}" in per_cpu for c in cpus):
            rows = [per_cpu[f"cpu{c}"] for c in cpus]
    idle = total = 0
    for row in rows:
        fields = [int(x) for x in row]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user / nice]
        idle, total = idle + fields[3] + fields[4], total + sum(fields[:8])
    return idle, total


def busy_cpus(available: int, interval_s: float = BUSY_SAMPLE_S, cpus: list[int] | None = None,
              read: Callable[[list[int] | None], tuple[int, int]] = _read_cpu_times) -> float | None:
    """Cores (of `available`) kept busy by other processes: the non-idle share over `interval_s`
    seconds, while this process sleeps, of the CPUs `cpus` it may run on (all CPUs when None),
    times `available`. A container that sees the host's /proc/stat still reads its own CPUs
    when its affinity names them. None where it cannot be read (no /proc/stat) or no time passed."""
    try:
        idle0, total0 = read(cpus)
        time.sleep(interval_s)
        idle1, total1 = read(cpus)
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return available * (1.0 - (idle1 - idle0) / (total1 - total0))


def apply_threads_flag(parser: argparse.ArgumentParser, threads: int | None) -> None:
    """`set_threads` for a script's own parser: a bad value is `parser.error` (one usage line,
    exit 2), as the `blockdraft` commands report it."""
    try:
        set_threads(threads)
    except ValueError as e:
        parser.error(str(e))
