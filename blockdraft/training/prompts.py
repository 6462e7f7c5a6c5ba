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
    one_turn = ([{"role": "user", "content": text.strip()}] for text in texts)
    kept, stats = _select(one_turn, eval_texts, num_prompts, min_chars, max_chars, min_ascii, seed)
    return [prefix[0]["content"] for prefix in kept], stats


def assert_no_eval_overlap(prompts: Iterable, eval_texts: Iterable[str]) -> None:
    """Raise ValueError naming the first training prompt (a text, or a chat message list: every
    message is checked) that overlaps an evaluation text."""
    index = EvalIndex(eval_texts)
    for p in prompts:
        for text in ([m["content"] for m in p] if isinstance(p, list) else [p]):
            if index.overlaps(text):
                raise ValueError(f"training prompt overlaps an evaluation prompt: {text[:120]!r}")


def select_later_turns(
    conversations: Iterable[list[dict]],
    eval_texts: Iterable[str],
    num_prompts: int,
    min_chars: int = 16,
    max_chars: int = 2000,
    min_ascii: float = 0.9,
    seed: int = 0,
) -> tuple[list[list[dict]], dict]:
    """Multi-turn training prompts: every prefix of a conversation that ends in its 2nd, 3rd, ...
    user turn (the earlier user and assistant turns kept as context), shuffled with `seed`, at most
    `num_prompts`. The target answers the last user turn; only that answer is trained on.

    Filters, in order: the last user turn's length in [min_chars, max_chars] characters; at least
    `min_ascii` ASCII characters over the whole prefix; first occurrence of each prefix
    (normalised); no message of the prefix overlapping `eval_texts` (EvalIndex).
    Args:
        conversations: chat message lists [{"role": "user" | "assistant", "content": str}],
            alternating from "user" (corpora.sharegpt_conversations).
    Returns:
        (prefixes, stats) where stats counts what each filter removed.
    """
    prefixes = ([{"role": m["role"], "content": m["content"].strip()} for m in conv[:end]]
                for conv in conversations for end in range(3, len(conv) + 1, 2))  # ends in user turn 2, 3, ...
    return _select(prefixes, eval_texts, num_prompts, min_chars, max_chars, min_ascii, seed)


def _select(
    prefixes: Iterable[list[dict]], eval_texts: Iterable[str], num_prompts: int, min_chars: int, max_chars: int,
    min_ascii: float, seed: int,
) -> tuple[list[list[dict]], dict]:
    """The filters of both selectors over chat prefixes (message lists ending in the user turn the
    target answers; a first-turn prompt is a one-message prefix), in order: the last message's
    length, the ASCII share over every message, first occurrence of the normalised prefix, no
    message overlapping `eval_texts`; then a `seed` shuffle and the first `num_prompts`.
    Returns (prefixes, stats) where stats counts what each filter removed."""
    index = EvalIndex(eval_texts)
    seen: set[str] = set()
    kept: list[list[dict]] = []
    stats = {"input": 0, "length": 0, "non_ascii": 0, "duplicate": 0, "eval_overlap": 0}
    for prefix in prefixes:
        stats["input"] += 1
        contents = [m["content"] for m in prefix]
        if not min_chars <= len(contents[-1]) <= max_chars:
            stats["length"] += 1
            continue
        if ascii_ratio("".join(contents)) < min_ascii:
            stats["non_ascii"] += 1
            continue
        key = "\x00".join(normalize(c) for c in contents)
        if key in seen:
            stats["duplicate"] += 1
            continue
        seen.add(key)
        if any(index.overlaps(c) for c in contents):
            stats["eval_overlap"] += 1
            continue
        kept.append(prefix)
    random.Random(seed).shuffle(kept)
    kept = kept[:num_prompts]
    stats["kept"] = len(kept)
    return kept, stats
