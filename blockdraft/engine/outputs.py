"""The two dataclasses of the CPU<->runner contract, and what the engine returns to users.

SchedulerOutput (engine -> runner) says which tokens of which requests to compute this step;
ModelRunnerOutput (runner -> engine) says what was sampled and drafted. The runner never sees a
Request object and the scheduler never sees a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from blockdraft.engine.request import SpecStats
from blockdraft.sampling_params import SamplingParams

# a token id of a step scheduled before the step that produces it is read back (async scheduling:
# Scheduler.schedule_continuation / schedule_join); the runner fills it in on the device
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    token_ids: the tokens to compute, at positions start_position.. (committed tokens, then
        `num_spec_tokens` drafts at the end). num_spec_tokens: drafts among them to verify.
    sample: True when these rows reach the end of the request's tokens, so the step samples
        (the last 1 + num_spec_tokens rows give logits). block_ids: the request's KV pages in order.
    sampling_params: the request's parameters (plain Python; the runner turns them into tensors).
    A continuation step (async scheduling, Scheduler.schedule_continuation) is scheduled before the
    previous step's tokens reach the host: its token_ids are PLACEHOLDER_TOKEN (-1) and its
    start_position -1; the runner builds both on the device from the previous step's output. A join
    step (Scheduler.schedule_join) has placeholder tokens at known positions.
    prompt_logprob_token_ids: with SamplingParams.prompt_logprobs, the prompt tokens this step
        scores (empty otherwise, and for rows whose prompt log-probabilities are known already):
        token j is scored by the logits of row `prompt_logprob_offset + j` of this request's rows
        (the row at position p gives log p(prompt[p + 1] | prompt[: p + 1])), so the rows are
        prompt rows before the prompt's last one; the last scored token may be the first token of
        the next chunk.
    logits_context: for a sampling request whose params adjust the logits (penalties, logit bias,
        min_tokens: blockdraft.sample.penalties), (the prompt's distinct token ids, sorted, [U]
        int64 on the CPU (Request.prompt_token_set, computed once), or None when no repetition
        penalty reads them; committed output token ids; the stop token ids min_tokens masks while
        the output is shorter: the EOS ids (also with ignore_eos, as vLLM) and stop_token_ids;
        empty once it is not); else None. The list and tensor are the request's own (read-only here), so a step that
        samples never copies them.
    grammar: for a sampling request with SamplingParams.structured_outputs, its grammar state
        (Request.grammar: the runner masks its logits rows with it), else None.
    token_mask: for a sampling request with allowed_token_ids or bad_words, its
        blockdraft.sample.token_mask.RequestTokenMask (Request.token_mask), else None.
        output_token_ids: its committed output token ids when that mask reads them (bad words of
        several tokens; the request's own list, read-only here), else empty.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    num_spec_tokens: int
    sample: bool
    block_ids: list[int]
    sampling_params: SamplingParams
    prompt_logprob_token_ids: Sequence[int] = ()  # a shared empty default: nothing allocated per step
    prompt_logprob_offset: int = 0
    logits_context: tuple[torch.Tensor | None, list[int], tuple[int, ...]] | None = None
    grammar: object | None = None
    token_mask: object | None = None
    output_token_ids: Sequence[int] = ()


@dataclass
class SchedulerOutput:
    """The batch of one step, in row order. total_num_tokens = sum of len(token_ids)."""

    requests: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass
class ModelRunnerOutput:
    """What the runner produced, keyed by request id (only for requests that sampled).

    sampled_token_ids[rid]: accepted drafts + the bonus token (1..K+1 tokens), before stop checks.
    num_accepted[rid]: drafts accepted. draft_token_ids[rid]: the next step's K drafts (empty
    without a speculator). logprobs[rid]: one dict per sampled token when asked.
    prompt_logprobs[rid]: one dict per ScheduledRequest.prompt_logprob_token_ids entry, in order.
    forward_time_s: seconds of the step's target phase: target forward + sampling + verification
        (a graphed step's verification is in its tail: draft_time_s; without a speculator the tail
        counts here). draft_time_s: seconds of the draft phase (the drafter proposing the next
        K drafts; about 0 without a speculator). Both from runner.step_timer (CUDA events on a GPU,
        so device time, not host launch time).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict]] = field(default_factory=dict)
    draft_time_s: float = 0.0
    forward_time_s: float = 0.0


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput): choice `index` of `RequestOutput.outputs`.

    text / token_ids / finish_reason / stop_reason / logprobs: as in RequestOutput.
    cumulative_logprob: the sum of the tokens' log-probabilities (natural log) when logprobs were
        asked for, else None (vLLM's).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the completion's token log-probabilities (nats), None without logprobs (vLLM's)."""
        return None if self.logprobs is None else sum(e["logprob"] for e in self.logprobs)

    def finished(self) -> bool:
        """True once the completion has ended (a finish_reason is set; vLLM's `finished()`)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's result so far (final when `finished`).

    text: detokenized output (stop string excluded; empty with SamplingParams.detokenize=False).
    token_ids: output token ids.
    finish_reason: "stop" | "length" | "abort" | None. spec: speculative counters.
    stop_reason: the stop string or stop_token_ids id that ended the request (vLLM's); None while
        running and when it ended at EOS, max_tokens / the context, or was aborted.
    ttft_s / latency_s: time to first token and total time, seconds from arrival.
    num_cached_tokens: prompt tokens whose KV came from the prefix cache when the request was first
        admitted (vLLM's; whole KV pages, so a multiple of kv_block_size); 0 with prefix caching
        off, on a miss, before admission, and for a request asking for prompt_logprobs (its prompt
        is recomputed). A readmission after preemption does not change it. With n > 1 in
        `LLM.generate`, the first completion's request's value.
    logprobs: with SamplingParams.logprobs, one {"token_id", "logprob", "top": [(token_id,
        logprob), ...]} per output token (an end-of-text token included), natural log; else None.
    prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token: None for the
        first, then a dict of the same form plus "rank" (log-probability of the prompt token given
        the tokens before it, its rank there: the number of tokens at least as likely, as vLLM's, and
        the N most likely tokens there); else None. Complete in every output that
        has a token (the prompt is computed before the first token is sampled).
    prompt: the prompt's text as `LLM.generate` got it (vLLM's `output.prompt`): the string, a
        conversation's chat-template text, None for token ids (and for the engine's own outputs).
    outputs: the completions as vLLM lists them (`outputs[0].text`, ...): this one alone, or with
        SamplingParams(n=N) in `LLM.generate` all N, in order; text / token_ids / finish_reason /
        stop_reason / logprobs above are then the first one's, and `spec` counts all N.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    spec: SpecStats
    ttft_s: float | None = None
    latency_s: float | None = None
    logprobs: list[dict] | None = None
    num_new_tokens: int = 0
    prompt_logprobs: list[dict | None] | None = None
    choices: list[CompletionOutput] | None = field(default=None, repr=False)
    prompt: str | None = None
    num_cached_tokens: int = 0

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's `RequestOutput.outputs`: every completion of the prompt (one unless n > 1)."""
        if self.choices is not None:
            return self.choices
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
