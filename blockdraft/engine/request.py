"""Per-request state kept by the engine (pure Python, no tensors).

Token-progress model (vLLM V1): a request holds its tokens, prompt + output, and
`num_computed_tokens`, the number of leading tokens whose KV is in the cache. Each step the scheduler
asks the runner to compute `(prompt + output)[num_computed:] + spec_token_ids` (or a chunk of it). After a
step that verified drafts, `num_computed_tokens` advances only over the anchor and the accepted drafts:
rejected drafts' KV is garbage and gets overwritten. Invariant while decoding:
`num_computed_tokens == num_tokens - 1` (the last token, the anchor, is not computed yet).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from blockdraft.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative decoding counters of one request (or summed over many).

    num_steps: verify steps that carried drafts. acceptance_length per step = accepted + 1.
    accepted_per_position[i]: steps whose draft i+1 was accepted (so >= i+1 accepted).
    drafted_per_position[i]: steps that drafted position i+1 (>= i+1 drafts). A step near
        max_tokens (or the model length) drafts fewer than K: its later positions were never
        proposed, so they count neither as accepted nor as drafted.
    Both lists are as long as the most drafts of any step.
    """

    num_steps: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Count one verify step with `num_drafts` drafts of which the first `num_accepted` matched."""
        if num_drafts == 0:
            return
        self.num_steps += 1
        self.num_drafted_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.accepted_per_position = _padded(self.accepted_per_position, num_drafts)
        self.drafted_per_position = _padded(self.drafted_per_position, num_drafts)
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        """Add another request's counters into these."""
        self.num_steps += other.num_steps
        self.num_drafted_tokens += other.num_drafted_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_per_position = _summed(self.accepted_per_position, other.accepted_per_position)
        self.drafted_per_position = _summed(self.drafted_per_position, other.drafted_per_position)

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens committed per verify step (accepted + 1), or None without drafts."""
        if self.num_steps == 0:
            return None
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps

    def acceptance_rate_per_position(self) -> list[float | None]:
        """For each draft position i (0-based): the fraction of the steps that drafted position
        i+1 whose draft i+1 was accepted, accepted_per_position[i] / drafted_per_position[i].
        None for a position no step drafted (JSON null; only counters built by hand, without
        drafted_per_position, lack the denominator: record() always fills it)."""
        return per_position_rates(self.accepted_per_position, self.drafted_per_position)


def per_position_rates(accepted: list[int], drafted: list[int]) -> list[float | None]:
    """accepted[i] / drafted[i] for each position of `accepted`; None where nothing was drafted
    (a rate with no denominator, never NaN: JSON has no NaN)."""
    return [a / drafted[i] if i < len(drafted) and drafted[i] else None for i, a in enumerate(accepted)]


def _padded(counts: list[int], n: int) -> list[int]:
    """`counts` extended with zeros to at least `n` entries."""
    return counts + [0] * (n - len(counts)) if len(counts) < n else counts


def _summed(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(_padded(a, n), _padded(b, n))]


@dataclass(eq=False)
class Request:
    """One generation request. `eos_token_ids` come from the model; params from the user.

    Compared by identity (eq=False): the scheduler's `in` / `remove` on its queues would otherwise
    compare every field of every queued request (quadratic in the batch, every step).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, length)
    block_ids: list[int] = field(default_factory=list)
    # prefix caching (engine.kv_cache_manager): chained hashes of the full pages of
    # prompt + output computed so far (kept across preemption: the tokens do not change), how many
    # leading pages of block_ids have been offered to the prefix cache, and the registration
    # serial naming the prefix those pages hold (0: none)
    page_hashes: list[int] = field(default_factory=list)
    num_registered_pages: int = 0
    prefix_serial: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # prompt tokens whose KV came from the prefix cache at the request's first admission (None
    # until it is admitted; 0 with caching off or a miss); set once, so a readmission after
    # preemption, which may hit its own pages, leaves it as it was (vLLM's num_cached_tokens)
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # tokens computed before it decodes again after a preemption (its prompt and output then; the
    # last is recomputed by the step that samples): engine.scheduler.is_prefilling
    num_recompute_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: the prompt tokens' entries computed so far, in order (None for
    # the first token, then RequestOutput.prompt_logprobs' dicts); stays [] when not asked for
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    # SamplingParams.structured_outputs: the grammar state over output_token_ids
    # (blockdraft.structured.grammar.RequestGrammar; set by the engine), else None
    grammar: object | None = None
    # SamplingParams.allowed_token_ids / bad_words: their masks (blockdraft.sample.token_mask.
    # RequestTokenMask; set by the engine), else None
    token_mask: object | None = None
    _prompt_token_set: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the request asks for prompt log-probabilities not all computed yet (its prompt
        rows must then be computed, not taken from the prefix cache)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids)

    def prompt_token_set(self) -> torch.Tensor:
        """The prompt's distinct token ids, sorted: [U] int64 on the CPU, computed once (the
        repetition penalty's prompt tokens, every step the request samples; sample.penalties)."""
        if self._prompt_token_set is None:
            self._prompt_token_set = torch.unique(torch.tensor(self.prompt_token_ids, dtype=torch.long))
        return self._prompt_token_set

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens at sequence indices start..stop-1 (prompt, then output, then drafts), as one list."""
        n_prompt, n_out = len(self.prompt_token_ids), len(self.output_token_ids)
        out: list[int] = []
        if start < n_prompt:
            out += self.prompt_token_ids[start:stop]
        if stop > n_prompt and start < n_prompt + n_out:
            out += self.output_token_ids[max(0, start - n_prompt) : stop - n_prompt]
        if stop > n_prompt + n_out:
            out += self.spec_token_ids[max(0, start - n_prompt - n_out) : stop - n_prompt - n_out]
        return out
