"""What `train-drafter --out` holds, and whether this run may write or resume it: the checks made
before anything loads (check_out_folder, check_data_folder, check_resume_target, check_resume_dtype,
check_resume_settings), a finished run found (finished_run) and a checkpoint --no-resume discards
(say_discarded_checkpoint). The layout itself: training/pipeline.py's module docstring."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from blockdraft.errors import check_unicode_text


# What train-drafter writes inside --out (the module docstring's layout): folders, then files. data/
# only without --data; checkpoint.new/ and .old/ are a checkpoint save's (training/atomic_folder.py).
RUN_FOLDERS = {"data": "dataset", "checkpoint": "checkpoint", "drafter": "exported drafter"}
RUN_FILES = {"train_log.jsonl": "training log", "summary.json": "summary"}
# Any of these in --out marks a train-drafter run there (one that can be resumed or reused); data/ and
# drafter/, common folder names (a project's own data/), mark one only by what a run writes in them
# (run_markers). summary.json alone marks none: it is a common file name, and a finished run holds the
# others too.
RUN_MARKERS = ("checkpoint", "checkpoint.new", "checkpoint.old", "train_log.jsonl")


def check_out_folder(out: str, data: str | None = None) -> None:
    """--out, before anything loads: a folder train-drafter can write its run into (the module
    layout in pipeline.py's module docstring) without overwriting anything of the user's.

    Refused: an empty (or whitespace-only) --out, which would write the run into the current
    folder; a folder that takes no new file (--out, or the nearest existing one above it: read-only,
    /proc); --out (or a folder above it) being a file, or a symbolic link to nothing (the run
    would fail making it once the target loaded); a path the run writes inside it that is of the
    other kind (data/ without --data, checkpoint/, drafter/ a file; train_log.jsonl, summary.json
    a folder), which the run would only fail on at its end; and a non-empty folder holding no
    train-drafter run (run_markers finds none; hidden files such as .DS_Store aside, and the --data
    folder, when inside it, being the run's own), whose files (say a summary.json, or a data/ of
    the user's) the run would write beside and over. A folder holding a run is its resume (or its
    data reused), and an empty or new one a new run.

    An --out or --data path that is not valid UTF-8 text is refused too (check_unicode_text).

    Raises:
        ValueError: naming --out, the offending path and what to do.
    """
    if not out.strip():
        raise ValueError(f"--out {out!r} is empty (it would write the run into the current folder): give the run's "
                         f"output folder, a new or empty one, e.g. --out runs/mine")
    for flag, path in (("--out", out), ("--data", data)):
        if path is not None:  # safetensors (Rust) takes UTF-8 paths only: it failed once the answers were made
            check_unicode_text(path, f"{flag} {path!r}")
    folder = Path(out)
    dangling = next((p for p in (folder, *folder.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:  # it would count as a new folder, and the run fail making it once the target loaded
        raise ValueError(f"--out {out!r}: {str(dangling)!r} is a symbolic link to {str(dangling.readlink())!r}, "
                         f"which does not exist: create that folder, or use another --out")
    taken = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if taken is not None and not taken.is_dir():  # the folder (or one above it) could never be made
        raise ValueError(f"--out {out!r}: {str(taken)!r} is a file; --out is the run's output folder")
    _check_writable(out, folder if folder.is_dir() else taken)
    if not folder.is_dir():
        return  # a new folder
    for name, what in RUN_FOLDERS.items():
        path = folder / name
        if (path.exists() or path.is_symlink()) and not path.is_dir() and not (name == "data" and data):
            raise ValueError(f"--out {out!r}: {str(path)!r} is a file, where the run writes its {what} folder; "
                             f"move it away or use another --out")
    for name, what in RUN_FILES.items():
        if (folder / name).is_dir():
            raise ValueError(f"--out {out!r}: {str(folder / name)!r} is a folder, where the run writes its {what} "
                             f"file; move it away or use another --out")
    entries = sorted(p.name for p in folder.iterdir())
    own = _top_entry_inside(Path(data), folder) if data else None  # a --data folder inside --out is the run's
    # hidden files (.DS_Store, .gitkeep) and an empty folder of the run's (a data/ whose answers were
    # removed to answer again) hold nothing the run would overwrite
    foreign = [name for name in entries if name != own and not name.startswith(".")
               and not (name in RUN_FOLDERS and _empty_folder(folder / name))]
    if foreign and not run_markers(folder):
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"--out {out!r} is a folder that holds no train-drafter run ({shown}; a run has "
                         f"checkpoint/, train_log.jsonl, a data/ of answers or an exported drafter/), and the run "
                         f"would write {', '.join(RUN_FILES)} and its folders over it: pick a new or empty folder "
                         f"for --out")


def _check_writable(out: str, folder: Path | None) -> None:
    """Refuse --out when `folder` (--out itself, or the nearest existing folder above a new one)
    takes no new file: found by creating and removing one, since permission bits do not tell
    (root, read-only mounts, immutable folders, /proc), so the run does not fail after loading."""
    import tempfile

    if folder is None:
        return
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"--out {out!r}: cannot write in {str(folder)!r} ({e.strerror or e}); give a folder this "
                         f"user can write") from None


def check_data_folder(data: str, out: str) -> None:
    """--data, before anything loads: a dataset folder train-drafter may read and (when it holds
    no finished dataset) write its answers into, without touching anything of the user's.

    Allowed: a new or empty folder (hidden files aside), or one that holds only a dataset's shards
    (dataset.SHARD_PATTERN) and an interrupted answering's journal (answer_journal.JOURNAL_DIR).
    Refused: --data being --out itself (the run's files would mix with the shards) and a folder
    holding anything else, e.g. a drafter folder, whose loader would then read the shards as
    weights, or a project's own files.

    Raises:
        ValueError: naming --data, the offending path or entries and what to do.
    """
    from blockdraft.training.answer_journal import JOURNAL_DIR
    from blockdraft.training.dataset import SHARD_PATTERN

    folder = Path(data)
    with contextlib.suppress(OSError):
        if folder.resolve() == Path(out).resolve():
            raise ValueError(f"--data {data!r} is --out itself; give the dataset its own folder (without --data the "
                             f"run keeps its answers in {str(Path(out) / 'data')!r})")
    if not folder.is_dir():
        return  # a new folder (a file was refused before)
    foreign = sorted(p.name for p in folder.iterdir()
                     if not p.name.startswith(".") and p.name != JOURNAL_DIR and not p.match(SHARD_PATTERN))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"--data {data!r} holds files that are not a train-drafter dataset ({shown}; a dataset folder "
                         f"holds only {SHARD_PATTERN} shards): the run would write its shards beside them (in a "
                         f"drafter folder the loader would then read them as weights); pick a new or empty folder, "
                         f"or a dataset folder an earlier run wrote")


def run_markers(folder: Path) -> list[str]:
    """What marks a train-drafter run in `folder`: checkpoint/ (or a save's checkpoint.new/, .old/)
    and train_log.jsonl by name (RUN_MARKERS); "data" when data/ holds a dataset's shards
    (dataset.SHARD_PATTERN) or an interrupted answering's journal (answer_journal.JOURNAL_DIR /
    JOURNAL_FILE); "drafter" when drafter/config.json is a DFlash drafter's
    (spec.dflash.config.is_dflash_config). An empty data/, or one of the user's own files, marks
    nothing."""
    found = [name for name in RUN_MARKERS if (folder / name).exists() or (folder / name).is_symlink()]
    data = folder / "data"
    if data.is_dir():
        from blockdraft.training.answer_journal import JOURNAL_DIR, JOURNAL_FILE
        from blockdraft.training.dataset import SHARD_PATTERN

        if any(data.glob(SHARD_PATTERN)) or (data / JOURNAL_DIR / JOURNAL_FILE).is_file():
            found.append("data")
    config = folder / "drafter" / "config.json"
    if config.is_file():
        from blockdraft.spec.dflash.config import is_dflash_config

        with contextlib.suppress(OSError, ValueError):  # not JSON, or not UTF-8: not a drafter train-drafter wrote
            raw = json.loads(config.read_text())
            if isinstance(raw, dict) and is_dflash_config(raw):
                found.append("drafter")
    return found


def _empty_folder(path: Path) -> bool:
    """`path` is a folder with nothing in it (one that cannot be listed counts as not empty)."""
    try:
        return path.is_dir() and not any(path.iterdir())
    except OSError:
        return False


def _top_entry_inside(path: Path, folder: Path) -> str | None:
    """The name of the entry of `folder` that `path` lies in (or is), None when outside it."""
    try:
        rel = path.resolve().relative_to(folder.resolve())
    except ValueError:
        return None
    return rel.parts[0] if rel.parts else None


def dtype_flag(asked: str, dtype: str, device: str) -> str:
    """--dtype as the user gave it, with what it resolved to when that differs: "--dtype float32" or
    "--dtype auto (bfloat16 on cuda)"."""
    return f"--dtype {asked}" + (f" ({dtype} on {device})" if asked != dtype else "")


def finished_run(out: Path, data: Path, cfg, drafter_config, train_vocab_size: int,
                 data_settings: dict | None = None) -> dict | None:
    """The summary of a run already finished in `out` (its dataset in `data`) with these training
    settings, None otherwise.

    Finished: its checkpoint reached cfg.steps with the same drafter shape and training settings
    (resuming it would train nothing) and summary.json was written after the export. Said on stderr
    with how to train more, as a resumed finished HF Trainer run would: a rerun is not an error, but
    it must not look as if it trained. Any other checkpoint is left to Trainer.load_checkpoint
    (resume, or refuse naming the settings that differ). `data_settings`: the data flags asked for;
    one that differs from the finished run's dataset makes this None too, so that the dataset
    check (reuse_dataset) refuses it by name instead of the rerun ignoring it.
    """
    from blockdraft.training.dataset import data_settings_differences
    from blockdraft.training.trainer import checkpoint_differences, read_checkpoint_state

    state = read_checkpoint_state(out)
    summary = out / "summary.json"
    if (state is None or state["step"] < cfg.steps or not summary.is_file()
            or not (out / "drafter" / "config.json").is_file()  # removed since: export it again
            or state["drafter_config"] != drafter_config.to_hf_dict()
            or checkpoint_differences(state, cfg, train_vocab_size)):
        return None
    made = json.loads(summary.read_text()).get("data", {}).get("settings", {})
    if data_settings_differences(made, data_settings or {}):
        return None
    print(f"train-drafter: {out} already holds a finished run ({state['step']} of {cfg.steps} steps done; its "
          f"drafter: {out / 'drafter'}), so there is nothing to train. To train more, start a new run from it: "
          f"--init-from {out / 'drafter'} --out NEW_FOLDER (with --data {data} to reuse its answers); a larger "
          f"--steps in this --out is refused (the learning-rate schedule was set for {cfg.steps}), --no-resume "
          f"trains this --out again from scratch", file=sys.stderr)
    return {**json.loads(summary.read_text()), "drafter": str(out / "drafter")}  # where it is now (moved runs)


# train-drafter's flag for each TrainConfig field a checkpoint records (others by their own name);
# --val-fraction decides which answers are trained on (split_validation), so it is one of them;
# --val-every, like --log-every and --ckpt-every, may change on resume (trainer.RESUMABLE_CHANGES)
RESUME_FLAGS = {"steps": "--steps", "batch_size": "--batch-size", "max_len": "--max-len", "num_anchors": "--num-anchors",
                "lr": "--lr", "seed": "--seed", "greedy_labels": "--greedy-labels",
                "train_vocab_size": "--train-vocab-size", "val_fraction": "--val-fraction"}

# train-drafter's flag for each drafter config entry a checkpoint's shape check compares
SHAPE_FLAGS = {"num_hidden_layers": "--num-layers", "intermediate_size": "--intermediate-size",
               "block_size": "--block-size", "mask_token_id": "--mask-token-id",
               "target_layer_ids": "--num-feature-layers (target_layer_ids)"}


def check_resume_settings(out: Path, cfg, train_vocab_size: int, drafter_config=None) -> None:
    """Refuse, before anything loads, to resume the checkpoint in `out` with other training settings
    or another drafter shape (`drafter_config`, a DFlashConfig; the checks Trainer.load_checkpoint
    makes once the target, answers and features are ready), naming each flag as given then and now.

    Raises:
        ValueError: a setting differs (the message says how to go on).
    """
    from blockdraft.training.trainer import (checkpoint_difference_items, drafter_config_differences,
                                             read_checkpoint_state)

    state = read_checkpoint_state(out)
    items = [] if state is None else checkpoint_difference_items(state, cfg, train_vocab_size)
    if state is not None and drafter_config is not None:
        shape = drafter_config_differences(state["drafter_config"], drafter_config.to_hf_dict())
        named = [item for item in shape if item[0] in SHAPE_FLAGS]  # entries that follow from them left out
        items += [(SHAPE_FLAGS.get(k, k), v, now) for k, v, now in (named or shape)]
    if not items:
        return

    def shown(value) -> str:
        return ("on" if value else "off") if isinstance(value, bool) else str(value)

    differ = ", ".join(f"{RESUME_FLAGS.get(k, k)} {shown(v)} (now {shown(now)})" for k, v, now in items)
    raise ValueError(f"the run in {out} (its checkpoint, step {state['step']}) was trained with {differ}: rerun with "
                     f"those to resume it (or to see it is finished), or start over with --no-resume or in another "
                     f"--out")


def recorded_target(out: Path, data: Path) -> tuple[str, str | None] | None:
    """(target name, its folder or None) the checkpoint in `out` was trained for, None without a
    checkpoint or a record. Its state.json's "target" / "target_path" (Trainer.target_name);
    a checkpoint written before they were recorded: the run's summary.json "target", else the
    "target" / "target_path" of its dataset in `data` (OUT/data or --data: dataset info, or an
    interrupted answering's journal.json). Reads only small files (no tensors)."""
    from blockdraft.training.answer_journal import AnswerJournal
    from blockdraft.training.dataset import SHARD_PATTERN
    from blockdraft.training.trainer import read_checkpoint_state

    state = read_checkpoint_state(out)
    if state is None:
        return None
    if isinstance(state.get("target"), str):
        return state["target"], state.get("target_path")
    records = []
    with contextlib.suppress(OSError, ValueError):
        records.append(json.loads((out / "summary.json").read_text()))
    shard = next(iter(sorted(data.glob(SHARD_PATTERN))), None) if data.is_dir() else None
    if shard is not None:
        from safetensors import safe_open

        with contextlib.suppress(Exception):  # a damaged shard: reuse_dataset names it later
            with safe_open(str(shard), framework="pt") as r:
                records.append(json.loads((r.metadata() or {}).get("info", "{}")))
    with contextlib.suppress(ValueError):
        records.append(AnswerJournal(data).header())
    for record in records:
        if isinstance(record, dict) and isinstance(record.get("target"), str):
            return record["target"], record.get("target_path")
    return None


def check_resume_target(out: Path, data: Path, target: str, target_path: str | None, own_data: bool) -> None:
    """Refuse, before anything loads, to resume the checkpoint in `out` for another target than
    the one it was trained for (recorded_target), saying only that: the drafter shape and mask token
    that follow from the target (check_resume_settings) would differ too, flags never given. The
    same target: same_target (as reuse_dataset compares a dataset's).

    Args:
        target_path: the target's folder: before anything is downloaded or converted,
            weights.fetch.model_folder's (a catalog name's cache folder, fetched or not, or a local
            HF folder); None where only resolving the target tells it (a .gguf file, whose folder
            is named by its hash): a recorded target not the same by name then passes, to be
            checked again with the folder once it is resolved.
        data: the run's dataset folder (OUT/data, or --data); own_data: it is OUT/data, whose
            answers are the other target's too, so --no-resume alone would meet reuse_dataset's
            refusal: the message says to remove it as well.
    Raises:
        ValueError: naming --out, both targets and the ways on (another --out, or --no-resume).
    """
    from blockdraft.weights.fetch import same_target

    recorded = recorded_target(out, data)
    if recorded is None:
        return
    name, path = recorded
    if target_path is None or same_target(name, path, target, target_path):
        return
    from blockdraft.training.answer_journal import AnswerJournal
    from blockdraft.training.dataset import SHARD_PATTERN

    answered = own_data and (any(data.glob(SHARD_PATTERN)) or AnswerJournal(data).folder.is_dir())
    over = (f"or remove {data} (the answers of {name!r}) and pass --no-resume to start it over for {target!r}"
            if answered else f"or --no-resume to start it over for {target!r}")
    raise ValueError(f"this run (--out {out}) was made for target {name!r}, not {target!r}: use another --out, "
                     f"{over}")


def check_resume_dtype(out: Path, dtype: str, asked: str, device: str) -> None:
    """A run resumed from the checkpoint in `out` keeps the target dtype it started with: its
    features so far (and its data/) came from the target in that dtype, and a resume in another one
    (say a CPU run moved to a GPU with --dtype auto) would mix fp32 and bf16 silently. `dtype`: the
    resolved --dtype `asked` on `device`, so an `auto` that resolves to the recorded dtype passes.
    A checkpoint written before the dtype was recorded is not checked: its run may have been either
    (--dtype bfloat16, or auto on CUDA, existed already), so it resumes as it did.

    Raises:
        ValueError: the checkpoint records another dtype (names both and what to do); raised
            before anything in `out` is written.
    """
    from blockdraft.training.trainer import read_checkpoint_state

    recorded = (read_checkpoint_state(out) or {}).get("target_dtype")
    if recorded is not None and recorded != dtype:
        now = dtype_flag(asked, dtype, device)
        raise ValueError(f"the run in {out} was trained with the target in {recorded} (its checkpoint); this run asks "
                         f"for {now}: continue it (or rerun it if finished) with --dtype {recorded}, or use a new "
                         f"--out to train in {dtype}")


def say_discarded_checkpoint(out: Path) -> None:
    """--no-resume over a checkpoint in `out`: one line on stderr saying it is discarded (the run's
    first checkpoint replaces it), with its step and planned steps, so that a run's progress is not
    thrown away unsaid. A damaged checkpoint (what --no-resume is for) is said as such."""
    from blockdraft.training.trainer import read_checkpoint_state

    try:
        state = read_checkpoint_state(out)
    except ValueError:
        print(f"train-drafter: --no-resume: the damaged checkpoint in {out / 'checkpoint'} is discarded; the "
              f"training starts over", file=sys.stderr, flush=True)
        return
    if state is None:
        return
    planned = (state.get("train_config") or {}).get("steps")
    of = f" of {planned}" if planned is not None else ""
    finished = " (finished)" if planned is not None and state["step"] >= planned else ""
    print(f"train-drafter: --no-resume: discarding the checkpoint at step {state['step']}{of}{finished} in "
          f"{out / 'checkpoint'}; the training starts over from step 0", file=sys.stderr, flush=True)
