"""Per-request sampling and stopping parameters (vLLM-compatible names)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 means greedy (argmax). top_k: 0 or -1 disables it. top_p in (0, 1].
    seed: makes sampling reproducible; the sample at output position q is a pure function of
    (seed, q, logits), so it does not depend on batch mates or on speculative decoding.
    max_tokens: output tokens at most (>= 1). stop: strings that end the output (not included in
    text). stop_token_ids: extra token ids that end the output (included in token ids, like EOS).
    ignore_eos: keep going past EOS. logprobs: number of top log-probabilities to return per output
    token (None: none; 0: only the sampled token's). detokenize: build the output text (default);
    False leaves `text` empty and skips decoding each new token (token ids only, e.g. training
    data; vLLM's `detokenize`), so it cannot be combined with stop strings.

    Raises:
        ValueError: naming the offending field and the allowed range (at construction, and again
            when the engine takes the request: fields changed since are checked too, `verify`).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    detokenize: bool = True
    _resolved_seed: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.verify()
        self._resolved_seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**31)

    def verify(self) -> None:
        """Normalise `stop` / `stop_token_ids` to lists and check every field (raises ValueError)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple, type(None))):
                raise ValueError(f"{name} must be a list (or None), got {getattr(self, name)!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("max_tokens (--max-tokens)", self.max_tokens, low=1)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature (--temperature) must be a number >= 0, got {self.temperature!r}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature (--temperature) must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p (--top-p) must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k (--top-k) must be an integer: 0 or -1 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None:
            _check_int("seed (--seed)", self.seed, low=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be True or False, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {self.stop!r} need the output text: drop them or keep detokenize=True")

    @property
    def greedy(self) -> bool:
        """True when the request decodes with argmax (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def resolved_seed(self) -> int:
        """The seed actually used: `seed`, or (None) a random one drawn once at construction."""
        return self.seed if self.seed is not None else self._resolved_seed


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
