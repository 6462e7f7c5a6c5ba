"""train-drafter's answering journal: the target's answers are saved as they are made, so that an
interrupted answering phase (Ctrl-C, SIGTERM) resumes where it stopped instead of starting over.

Layout of DATA/partial/ (DATA: OUT/data or --data; removed once the dataset is saved there):
    journal.json                what the answers are made with (`answering_header`: target, --dtype,
                                data settings, --seed, --max-num-seqs, wave size); a resume with
                                others is refused naming them (`check_journal`)
    synth-NNNNN.safetensors     wave N of the --synth-prompts requests the target wrote
    requests.safetensors        every request to answer (prompt ids, sampled flags) and the prompt
                                stats: written once, after the prompts are chosen and synthesized
    answers-NNNNN.safetensors   the answers of wave N
Each file is written whole under a temporary name and renamed (dataset.save_safetensors_atomic):
a file under its own name is complete, so a second Ctrl-C or a kill midway loses nothing saved.

Why waves: the engine's answer to a request depends on its batch mates in the last bits of the
logits (SmolLM2 on the CPU in float32, train-drafter's unpacked weights: 7 requests answered among 12
at 8 at once, then by themselves at 3 at once, differed by up to 1.2e-5 in their log-probabilities),
enough to flip a near-tie, so answering only the unanswered requests in new batches would not give the answers
of an uninterrupted run. The requests are answered in fixed waves of WAVE_BATCHES x max_num_seqs
consecutive ones, each from an empty engine: a wave's answers depend only on its own requests (a
wave run after another one equalled it run on a fresh engine bit for bit, log-probabilities
included), so the resumed waves come out as an uninterrupted run's.
A stop drops the wave in progress (its finished answers included: answering it again alone would
change its batches), so an interrupt loses at most one wave.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from blockdraft.training.dataset import data_settings_differences, save_safetensors_atomic

JOURNAL_DIR = "partial"  # not data-*.safetensors: reuse_dataset never takes it for a finished dataset
JOURNAL_FILE = "journal.json"  # in JOURNAL_DIR: written first, so a journal without it holds nothing to resume
FORMAT = 1
# max_num_seqs batches per wave: the engine drains (runs fewer requests at once) at each wave's end, so
# more batches per wave cost less throughput, and fewer lose less to an interrupt (on the CPU, 4 x 32
# = 128 of the default 2,000 prompts; on CUDA, 4 x 512 = all of them: one wave). SmolLM2 on the CPU,
# 64 ShareGPT prompts, 64 new tokens, max_num_seqs 4: 994 engine steps in one wave, 1,024 in waves
# of 16 (+3 %; most answers ran to the 64 tokens, so longer, more varied ones may drain more).
WAVE_BATCHES = 4
STAGES = ("synth", "answers")


class AnsweringStopped(Exception):
    """The answering was told to stop (should_stop): `done` of `total` requests of `stage` are saved.
    Stopped within a wave, `dropped` of its `wave` requests had finished and are not kept (the wave
    is saved whole or not at all: the module docstring); stopped between waves, both are 0."""

    def __init__(self, stage: str, done: int, total: int, dropped: int = 0, wave: int = 0):
        super().__init__(f"{stage}: stopped at {done} of {total}")
        self.stage, self.done, self.total, self.dropped, self.wave = stage, done, total, dropped, wave


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as JSON in `path`, whole or not at all (temporary file, then os.replace)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _pack(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "offsets": torch.tensor(offsets, dtype=torch.int64)}


def _unpack(tokens: torch.Tensor, offsets: torch.Tensor) -> list[list[int]]:
    flat, cut = tokens.tolist(), offsets.tolist()
    return [flat[cut[i]:cut[i + 1]] for i in range(len(cut) - 1)]


class AnswerJournal:
    """The journal of the dataset folder `data_folder` (see the module docstring), read and written
    by file; nothing is cached, so what a method returns is what is on disk."""

    def __init__(self, data_folder: Path):
        self.folder = Path(data_folder) / JOURNAL_DIR

    def header(self) -> dict | None:
        """journal.json, None when there is none.

        Raises:
            ValueError: it is not valid JSON (names the file and how to start over).
        """
        path = self.folder / JOURNAL_FILE
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); remove {self.folder} to answer again") from e

    def start(self, header: dict) -> None:
        """Create the journal with `header` (its journal.json) unless it exists (check_journal
        compares an existing one first). Files left without a journal.json (a removal cut short)
        are deleted first: nothing says what they were made with."""
        if (self.folder / JOURNAL_FILE).is_file():
            return
        self.remove()
        self.folder.mkdir(parents=True)
        write_json_atomic(self.folder / JOURNAL_FILE, header)

    def _read(self, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as r:
                return {k: r.get_tensor(k) for k in r.keys()}, json.loads((r.metadata() or {}).get("meta", "{}"))
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); remove {self.folder} to answer "
                             f"again") from e

    def save_requests(self, prompts: list[list[int]], sampled: list[bool], stats: dict) -> None:
        """Record the requests to answer: prompt token ids, sampled flags, the prompt stats (JSON)."""
        tensors = {**_pack(prompts), "sampled": torch.tensor([int(s) for s in sampled], dtype=torch.uint8)}
        save_safetensors_atomic(tensors, self.folder / "requests.safetensors", {"meta": json.dumps({"stats": stats})})

    def requests(self) -> tuple[list[list[int]], list[bool], dict] | None:
        """(prompts, sampled, stats) as save_requests recorded them; None before it ran."""
        path = self.folder / "requests.safetensors"
        if not path.is_file():
            return None
        t, meta = self._read(path)
        return _unpack(t["tokens"], t["offsets"]), [bool(s) for s in t["sampled"].tolist()], meta["stats"]

    def save_wave(self, stage: str, wave: int, first: int, responses: list[list[int]], seconds: float) -> None:
        """Record wave `wave` of `stage` ("synth" | "answers"): the responses of requests `first`..,
        and the seconds it took."""
        save_safetensors_atomic(_pack(responses), self.folder / f"{stage}-{wave:05d}.safetensors",
                                {"meta": json.dumps({"first": first, "seconds": round(seconds, 3)})})

    def waves(self, stage: str) -> dict[int, tuple[int, list[list[int]], float]]:
        """{wave: (first request, responses, seconds)} of the waves of `stage` saved so far."""
        out = {}
        for path in sorted(self.folder.glob(f"{stage}-*.safetensors")):
            found = re.fullmatch(rf"{stage}-(\d+)\.safetensors", path.name)
            if found:
                t, meta = self._read(path)
                out[int(found[1])] = (meta["first"], _unpack(t["tokens"], t["offsets"]), meta["seconds"])
        return out

    def seconds(self) -> float:
        """Seconds the saved waves of every stage took (over all the runs that made them)."""
        return sum(s for stage in STAGES for _, _, s in self.waves(stage).values())

    def remove(self) -> None:
        """Delete the journal folder and everything in it (no error when it is absent)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def answering_header(target: str, target_path: str, vocab_size: int, settings: dict, seed: int, dtype: str,
                     max_num_seqs: int) -> dict:
    """journal.json of an answering run: what its answers depend on. `settings`: the data settings
    (pipeline.DATA_SETTINGS); `dtype`: the resolved target dtype; `max_num_seqs`: the answering
    engine's (its batches, hence the answers at near-ties)."""
    return {"format": FORMAT, "target": target, "target_path": target_path, "vocab_size": vocab_size,
            "settings": settings, "seed": seed, "dtype": dtype, "max_num_seqs": max_num_seqs,
            "wave_size": WAVE_BATCHES * max_num_seqs}


def journal_differences(recorded: dict, now: dict) -> list[tuple[str, object, object]]:
    """(flag, recorded, now) for each way the journal header `recorded` differs from `now` (both
    answering_header dicts), in flag order. The target counts as the same when its name or its
    resolved folder matches (weights.fetch.same_target: a catalog name then its folder is the same
    model, and a folder is the same however its path is spelled)."""
    from blockdraft.weights.fetch import same_target

    differ = []
    if recorded.get("format") != now["format"]:
        differ.append(("journal format", recorded.get("format"), now["format"]))
    if not same_target(recorded.get("target"), recorded.get("target_path"), now["target"], now["target_path"]):
        differ.append(("--target", repr(recorded.get("target")), repr(now["target"])))
    if recorded.get("vocab_size") != now["vocab_size"]:
        differ.append(("vocab size", recorded.get("vocab_size"), now["vocab_size"]))
    differ += [(f"--{k.replace('_', '-')}", was, value)
               for k, was, value in data_settings_differences(recorded.get("settings", {}), now["settings"])]
    for key, flag in (("seed", "--seed"), ("dtype", "--dtype"), ("max_num_seqs", "--max-num-seqs")):
        if recorded.get(key) != now[key]:
            differ.append((flag, recorded.get(key), now[key]))
    if not differ and recorded.get("wave_size") != now["wave_size"]:  # another WAVE_BATCHES (another version)
        differ.append(("answer wave size", recorded.get("wave_size"), now["wave_size"]))
    return differ


def check_journal(journal: AnswerJournal, now: dict, other: str = "") -> None:
    """Refuse to continue a journal made with other settings than `now` (answering_header): its
    answers would be mixed with answers of another kind. Nothing is checked without a journal.

    Args:
        other: appended to "use a new --out" in the message (" (or another --data folder)").
    Raises:
        ValueError: naming the journal's folder, each differing setting as recorded and as asked
            now, and what to do (rerun with those, remove the folder, or a new --out).
    """
    recorded = journal.header()
    differ = [] if recorded is None else journal_differences(recorded, now)
    if differ:
        was, asked = ", ".join(f"{w} {r}" for w, r, _ in differ), ", ".join(f"{w} {a}" for w, _, a in differ)
        raise ValueError(
            f"the answers saved so far in {journal.folder} (an interrupted answering) were made with {was}; this run "
            f"asks for {asked}. An answering resumes only with the same target, --dtype, data settings, --seed and --max-num-seqs (an "
            f"answer can depend on its batch at near-ties): rerun with those to resume it, remove {journal.folder} "
            f"to answer again, or use a new --out{other}")


def answer_in_waves(journal: AnswerJournal, stage: str, llm, prompts: list[list[int]], sampled: list[bool],
                    max_new_tokens: int, temperature: float, seed: int, wave_size: int,
                    should_stop: Callable[[], bool] | None = None, progress: bool = False) -> list[list[int]]:
    """The responses to `prompts` (generate.generate_with_engine: greedy, or sampled at
    `temperature` with seed `seed + i` for prompt i), answered in waves of `wave_size` consecutive
    prompts, each wave saved to `journal` as it completes; the waves saved already (an interrupted
    run's) are read back instead of answered, said on stderr.

    `should_stop` is checked before each engine step: once it returns True the wave in progress is
    dropped at once (its in-flight and queued requests aborted, its finished answers not kept: see
    the module docstring) and AnsweringStopped is raised with the count of saved responses and,
    stopped within a wave, of the finished ones dropped with it.
    Raises:
        AnsweringStopped: as above (the journal holds every wave completed before it).
        ValueError: a saved wave does not hold the requests its number stands for (a damaged journal).
    """
    from tqdm.auto import tqdm

    from blockdraft.training import generate  # by module: tests replace generate_with_engine

    n, stop = len(prompts), should_stop or (lambda: False)
    saved = journal.waves(stage)
    out: list[list[int] | None] = [None] * n
    for k, (first, responses, _) in saved.items():
        if first != k * wave_size or first + len(responses) != min(n, first + wave_size):
            raise ValueError(f"{journal.folder}: {stage} wave {k} holds requests {first}..{first + len(responses) - 1}, "
                             f"not those of a wave of {wave_size} of {n}; remove {journal.folder} to answer again")
        out[first:first + len(responses)] = responses
    done = sum(o is not None for o in out)
    what = "prompts answered" if stage == "answers" else "--synth-prompts requests written"
    if done:
        print(f"train-drafter: resuming from {journal.folder}: {done} of {n} {what} already saved", file=sys.stderr,
              flush=True)
    bar = tqdm(total=n, initial=done, desc="answer" if stage == "answers" else "synthesize", unit="req",
               disable=not progress)
    try:
        for k, first in enumerate(range(0, n, wave_size)):
            if k in saved:
                continue
            if stop():
                raise AnsweringStopped(stage, done, n)
            last = min(n, first + wave_size)
            t0 = time.perf_counter()
            responses = generate.generate_with_engine(llm, prompts[first:last], max_new_tokens, sampled[first:last],
                                                      temperature, seed + first, should_stop=stop,
                                                      on_finished=lambda: bar.update(1))
            if any(r is None for r in responses):  # stopped within the wave: dropped whole
                finished = sum(r is not None for r in responses)
                bar.update(-finished)
                raise AnsweringStopped(stage, done, n, dropped=finished, wave=last - first)
            journal.save_wave(stage, k, first, responses, time.perf_counter() - t0)
            out[first:last] = responses
            done += last - first
    finally:
        bar.close()
    return out
