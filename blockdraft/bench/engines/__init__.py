"""The engines a benchmark compares, behind one small interface (`BenchEngine`).

Each engine decodes a batch of token-id prompts greedily for exactly `max_tokens` tokens (EOS
ignored) and says how many target forwards it ran; the caller times it (bench/measure.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

PLAIN, DFLASH, FORCED = "plain", "dflash", "dflash-forced"


@dataclass
class Generation:
    """One batch's result.

    token_ids: per request, the output token ids (prompt excluded), in prompt order.
    num_steps: target forwards run (prefill included): the denominator of ms per step.
    acceptance_length: mean tokens committed per verify step with drafts, pooled over requests
        (None for plain decoding).
    """

    token_ids: list[list[int]]
    num_steps: int
    acceptance_length: float | None = None


class BenchEngine(Protocol):
    """What the measurement loop needs from an engine."""

    engine: str  # "ours" | "hf" | "zlab"
    mode: str  # PLAIN | DFLASH | FORCED

    def unsupported(self, batch_size: int) -> str | None:
        """Why this engine cannot run `batch_size` concurrent requests, or None if it can."""
        ...

    def generate(self, prompts: list[list[int]], max_tokens: int, concurrency: int | None = None) -> Generation:
        """Greedy-decode every prompt for exactly `max_tokens` tokens, with at most `concurrency`
        requests in flight (None: all at once)."""
        ...
