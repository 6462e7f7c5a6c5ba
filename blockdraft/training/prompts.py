"""Training prompt selection: clean, deduplicate, and keep evaluation prompts out.

Contamination rule (the usual n-gram check, cf. GPT-3 appendix C): a training prompt is dropped when
its normalised text equals an evaluation text, or when it shares any `NGRAM`-word shingle with one.
HumanEval and MT-bench are evaluation only (issue 4); `assert_no_eval_overlap` is the test's oracle.
"""

from __future__ import annotations

import random
import re
from typing import Iterable

NGRAM = 13  # words per shingle for the contamination check

_WS = re.compile(r"\s+")
_WORD = re.compile(r"\w+")


def normalize(text: str) -> str:
    """Lower-case, whitespace collapsed to single spaces, stripped: the dedup key."""
    return _WS.sub(" ", text).strip().lower()


def shingles(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """All n-word windows of the lower-cased word tokens of `text` (empty if shorter than n)."""
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class EvalIndex:
    """Normalised texts and n-gram shingles of the evaluation prompts, for overlap queries."""

    def __init__(self, eval_texts: Iterable[str], n: int = NGRAM) -> None:
        texts = list(eval_texts)
        self.n = n
        self.exact = {normalize(t) for t in texts}
        self.grams: set[tuple[str, ...]] = set().union(*(shingles(t, n) for t in texts)) if texts else set()

    def overlaps(self, text: str) -> bool:
        """True if `text` equals an eval text (normalised) or shares an n-gram shingle with one."""
        return normalize(text) in self.exact or not self.grams.isdisjoint(shingles(text, self.n))


def ascii_ratio(text: str) -> float:
    """Fraction of characters that are ASCII (1.0 for an empty string)."""
    return sum(c < "\x80" for c in text) / len(text) if text else 1.0


def select_prompts(
    texts: Iterable[str],
    eval_texts: Iterable[str],
    num_prompts: int,
    min_chars: int = 16,
    max_chars: int = 2000,
    min_ascii: float = 0.9,
    seed: int = 0,
) -> tuple[list[str], dict]:
    """Clean, deduplicated, eval-free training prompts, shuffled with `seed`, at most `num_prompts`.

    Filters, in order: length in [min_chars, max_chars] characters (after stripping), at least
    `min_ascii` ASCII characters (the evaluation sets are English), first occurrence of each
    normalised text, no overlap with `eval_texts` (EvalIndex).
    Returns:
        (prompts, stats) where stats counts what each filter removed.
    """
    index = EvalIndex(eval_texts)
    seen: set[str] = set()
    kept: list[str] = []
    stats = {"input": 0, "length": 0, "non_ascii": 0, "duplicate": 0, "eval_overlap": 0}
    for raw in texts:
        stats["input"] += 1
        text = raw.strip()
        if not min_chars <= len(text) <= max_chars:
            stats["length"] += 1
            continue
        if ascii_ratio(text) < min_ascii:
            stats["non_ascii"] += 1
            continue
        key = normalize(text)
        if key in seen:
            stats["duplicate"] += 1
            continue
        seen.add(key)
        if index.overlaps(text):
            stats["eval_overlap"] += 1
            continue
        kept.append(text)
    random.Random(seed).shuffle(kept)
    kept = kept[:num_prompts]
    stats["kept"] = len(kept)
    return kept, stats


def assert_no_eval_overlap(prompts: Iterable[str], eval_texts: Iterable[str]) -> None:
    """Raise ValueError naming the first training prompt that overlaps an evaluation text."""
    index = EvalIndex(eval_texts)
    for p in prompts:
        if index.overlaps(p):
            raise ValueError(f"training prompt overlaps an evaluation prompt: {p[:120]!r}")
