"""The engine loop: schedule -> run (target forward, verify, propose) -> commit with stop checks."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

from blockdraft.engine.detokenizer import IncrementalDetokenizer, NoDetokenizer
from blockdraft.engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from blockdraft.engine.request import Request, SpecStats
from blockdraft.engine.scheduler import Scheduler
from blockdraft.errors import param_error
from blockdraft.prompt_truncation import truncate_prompt
from blockdraft.sample.bad_words import bad_words_token_ids
from blockdraft.sample.token_mask import RequestTokenMask
from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, check_logprobs_limit, check_max_logprobs

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Totals since the engine started: steps, tokens, seconds in each phase, speculative counters."""

    num_steps: int = 0
    num_async_steps: int = 0  # steps launched before the previous step's tokens were read back
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    forward_time_s: float = 0.0
    draft_time_s: float = 0.0
    spec: SpecStats = field(default_factory=SpecStats)


class LLMEngine:
    """Owns the scheduler and the runner; users add requests and call `step()`.

    The runner's `launch(SchedulerOutput)` / `finish(launched) -> ModelRunnerOutput` are the only
    calls into tensor land (plus `can_continue` / `launch_continuation` and `can_join` /
    `launch_join` with async scheduling).

    async_scheduling (vLLM's --async-scheduling): while a uniform decode step runs on the device,
    the next step of the same requests is launched from its device output before its tokens are
    read back, so the GPU does not wait for the host's bookkeeping (commit, stop checks, scheduling,
    input preparation) between steps; without mixed prefill, when a request waits to start, the
    prefill step of the waiting requests is launched that way instead (it needs no token of the
    step before; a request that arrives while it runs is prefilled right behind it), and after
    it the uniform step in which its requests join the running ones
    (Scheduler.schedule_join: their first token and drafts are copied from the prefill's device
    output; the others' rows are known on the host), before the prefill is read back. Stop
    conditions are then applied one step late: a request that stops at step N has also been
    computed in step N+1, whose tokens for it are dropped; step N+2 leaves it out (the others'
    rows gathered from N+1's device output). The output is the same token for token. The chain
    of such steps breaks (one synchronous step) when a request needs pages the pool lacks, its
    drafts would pass the context limit, or a step fits no graph. A request that arrives mid-chain
    is admitted one step later than without async scheduling, and one step may carry a stopped
    request's rows: the batch of a step can differ, which in bf16 can flip a token at a near-tie,
    as any change of batch composition can.

    max_logprobs: the largest `SamplingParams.logprobs` / `prompt_logprobs` a request may ask for
    (vLLM's max_logprobs); more is refused when the request is added. max_position_embeddings: the
    model's own context (its config.json; None: not known), so that the error about a prompt too long
    for max_model_len offers raising max_model_len only where that could help.

    Prompt log-probabilities (SamplingParams.prompt_logprobs): the scheduler marks the prompt rows
    of each step whose logits score a prompt token (ScheduledRequest.prompt_logprob_token_ids), the
    runner scores them chunk by chunk (runner.prompt_logprobs), and `_commit` appends them to the
    request in order; such a request takes no prefix-cache hit until they are all known.
    """

    def __init__(
        self, scheduler: Scheduler, runner, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int,
        vocab_size: int | None = None, async_scheduling: bool = False, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        max_position_embeddings: int | None = None,
    ):
        check_max_logprobs(max_logprobs)
        self.max_logprobs = max_logprobs
        self.scheduler = scheduler
        # where unseeded requests draw their seeds (LLM(seed=...): reproducible; None: OS randomness)
        self.seed_rng: random.Random | None = None
        self.vocab_size = vocab_size  # prompt / stop ids must lie in [0, vocab_size) (None: unchecked)
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # the model's own context (None: not known); a prompt over it cannot be helped by raising max_model_len
        self.max_position_embeddings = max_position_embeddings
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer | NoDetokenizer] = {}
        self._num_new: dict[str, int] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}  # EOS (unless ignore_eos) + stop_token_ids
        self._finished_unreported: list[Request] = []
        self.async_scheduling = async_scheduling
        self._inflight = None  # (its Requests, launched step) launched but not read back yet
        self._grammars = None  # blockdraft.structured.grammar.GrammarCompiler, at the first constrained request
        self._grammars_lock = threading.Lock()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (after `check_request`; nothing is queued when it raises).

        Raises:
            ValueError: duplicate id, or as `check_request`.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = self.check_request(prompt_token_ids, params)  # truncated (truncate_prompt_tokens)
        params = params.for_request(self.seed_rng)  # unseeded: its own seed (vLLM: independent samples)
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        if params.structured_outputs is not None:
            req.grammar = self._grammar_compiler().matcher(params.structured_outputs, block_eos=params.ignore_eos)
        if params.masks_tokens:
            req.token_mask = RequestTokenMask(*self._token_mask_inputs(params))
        self.scheduler.add_request(req)
        self._requests[request_id] = req
        detok = (IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output,
                                        params.skip_special_tokens, params.spaces_between_special_tokens)
                 if params.detokenize else NoDetokenizer())
        self._detok[request_id] = detok
        eos = () if params.ignore_eos else self.eos_token_ids
        self._stop_ids[request_id] = frozenset(params.stop_token_ids).union(eos)
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Raise unless the request could be queued; queues nothing (callers check a whole batch first).

        Args:
            prompt_token_ids: the prompt's token ids (non-empty).
            params: its SamplingParams (n == 1).
        Returns:
            the prompt `add_request` queues: its last params.truncate_prompt_tokens tokens
            (blockdraft.prompt_truncation), or `prompt_token_ids` itself without truncation. The
            checks below are on that prompt, as vLLM truncates before it validates.

        Raises:
            TypeError: `params` is not a SamplingParams.
            ValueError: a field of `params` out of range (SamplingParams.verify: a field changed
                after construction is checked here); `n` != 1; `logprobs` or `prompt_logprobs`
                above `max_logprobs`; a prompt, stop_token_ids, logit_bias or allowed_token_ids
                token id outside [0, vocab_size), or a bad word tokenized to one (names the
                first one; `.param` the field, the prompt excepted); an empty prompt;
                truncate_prompt_tokens above `max_model_len`; a (truncated) prompt that leaves no
                room for one output token within `max_model_len` (names the lengths); a
                structured_outputs constraint that does not compile (names its field and why).
            ImportError: structured_outputs without the llguidance package.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__} {params!r:.80}")
        params.verify()
        if params.n != 1:
            raise param_error("n", f"n must be 1 for an LLMEngine request (one completion each), got {params.n}: "
                                   f"LLM.generate runs n > 1 as n requests (SamplingParams.completions)")
        check_logprobs_limit(params, self.max_logprobs)
        prompt_token_ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        if self.vocab_size is not None:
            for what, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                              ("logit_bias", list(params.logit_bias or ()))):
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    message = f"{what} has token id {bad}, outside the vocabulary [0, {self.vocab_size})"
                    raise ValueError(message) if what == "prompt" else param_error(what, message)
        if params.masks_tokens:
            self._token_mask_inputs(params)
        if params.structured_outputs is not None:
            self._grammar_compiler().check(params.structured_outputs)
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            # -1 keeps max_model_len tokens (vLLM's value), which leave no room: say what fits
            # output tokens the hint leaves room for
            room = max(1, min(params.max_output_tokens, self.max_model_len - 1))
            cut = "" if params.truncate_prompt_tokens is None else (
                f" (after truncate_prompt_tokens={params.truncate_prompt_tokens}; "
                f"truncate_prompt_tokens={self.max_model_len - room} leaves room for max_tokens={room})")
            kv = self.scheduler.kv
            if self.max_model_len == kv.num_blocks * kv.kv_block_size:  # the pool caps the context
                remedy = (f"shorten the prompt or enlarge the KV pool, whose {kv.num_blocks} pages x {kv.kv_block_size} "
                          f"tokens cap the context (num_kv_blocks, serve's --num-kv-blocks; on a GPU "
                          f"gpu_memory_utilization)")
            elif self.max_position_embeddings is not None and self.max_model_len >= self.max_position_embeddings:
                remedy = ("shorten the prompt: this is the model's whole context (max_position_embeddings in its "
                          "config.json); truncate_prompt_tokens=N (SamplingParams and the server's field; generate's "
                          "--truncate-prompt-tokens) keeps a prompt's last N tokens")
            else:
                remedy = ("shorten the prompt or raise max_model_len (the CLI's --max-model-len; its default is the "
                          "smaller of the model's max positions and the KV pool)")
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens but the engine's context is {self.max_model_len} "
                f"tokens (max_model_len: at most {self.max_model_len - 1} prompt tokens leave room for one output "
                f"token): {remedy}{cut}"
            )
        return prompt_token_ids

    def prepare_structured_outputs(self, params: list[SamplingParams]) -> None:
        """Compile the constraints of `params` (SamplingParams.structured_outputs) ahead of
        `add_request`, which then finds them in the compiler's cache (the last 128 constraints)
        and only copies the compiled state. Thread-safe: a server calls it from a worker thread,
        so compiling (and, once, reading the tokenizer's vocabulary, ~0.7 s for Qwen) does not
        stall the engine thread's steps.

        Raises:
            ValueError / ImportError: as `check_request` for a constraint.
        """
        for p in params:
            if p.structured_outputs is not None:
                p.structured_outputs.verify()
                self._grammar_compiler().check(p.structured_outputs)

    def _token_mask_inputs(self, params: SamplingParams) -> tuple[int, list[int] | None, list[list[int]]]:
        """RequestTokenMask's arguments for params.allowed_token_ids / bad_words: (the logits width
        V, the allowed ids, the bad words' token sequences, blockdraft.sample.bad_words).

        Raises:
            ValueError: about allowed_token_ids or bad_words (`.param`) when an id, or a word's
                token, lies outside [0, V) (a tokenizer larger than the model's logits); about
                allowed_token_ids when no allowed id can ever be sampled (each is a one-token bad
                word) or, with min_tokens, none before min_tokens (each is an EOS or stop token id):
                such rows would have every token masked.
        """
        vocab_size = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
        sequences = bad_words_token_ids(params.bad_words or (), self.tokenizer)
        for what, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words", [t for seq in sequences for t in seq])):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise param_error(what, f"{what} has token id {bad}, outside the vocabulary [0, {vocab_size})")
        if params.allowed_token_ids:
            allowed = set(params.allowed_token_ids) - {seq[0] for seq in sequences if len(seq) == 1}
            if not allowed:
                raise param_error("allowed_token_ids", f"bad_words ban every id of allowed_token_ids "
                                  f"{sorted(params.allowed_token_ids)[:8]}: no token could be sampled")
            stops = set(self.eos_token_ids).union(params.stop_token_ids or ())
            if params.min_tokens and allowed <= stops:
                raise param_error("allowed_token_ids", f"allowed_token_ids {sorted(allowed)[:8]} are all EOS or stop "
                                  f"token ids, which min_tokens={params.min_tokens} masks: no token could be "
                                  f"sampled before min_tokens")
        return vocab_size, params.allowed_token_ids, sequences

    def _grammar_compiler(self):
        """The engine's GrammarCompiler (built once: llguidance reads the tokenizer's vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                from blockdraft.structured.grammar import GrammarCompiler

                vocab_size = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
                self._grammars = GrammarCompiler(self.tokenizer, vocab_size, tuple(self.eos_token_ids))
        return self._grammars

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV pages (no-op for unknown or finished ids)."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return
        self._finish(req, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (KVCacheManager.reset_prefix_cache); False (nothing changed)
        while a request is unfinished or a step of unfinished requests is in flight."""
        if self._inflight is not None and all(r.is_finished for r in self._inflight[0]):
            self._inflight = None  # aborted meanwhile (as step() drops it): nothing to read back
        if self._inflight is not None or self.scheduler.has_unfinished():
            return False
        return self.scheduler.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One engine step. Returns outputs of requests that produced tokens or finished.

        stream=False returns the finished requests' outputs only (all `LLM.generate` reads): the
        others build no RequestOutput (a copy of all their tokens) this step; stats are the same.

        With async scheduling a step reads back the step launched by the previous call and may
        launch the next one first; a step whose requests have all stopped meanwhile is dropped
        unread (so `has_unfinished_requests()` can be False while it still runs on the device).
        """
        if self._inflight is not None:
            reqs, launched = self._inflight
            sched_out = launched.so
            self._inflight = None
            self.stats.num_async_steps += 1
        else:
            sched_out = self.scheduler.schedule()
            if not sched_out.requests:
                return self._pop_finished_outputs()
            reqs = [self._requests[sr.request_id] for sr in sched_out.requests]
            launched = self.runner.launch(sched_out)
        try:
            if self.async_scheduling:
                self._inflight = self._launch_next(sched_out, reqs, launched)
            run_out = self.runner.finish(launched)
            self._commit(sched_out, reqs, run_out)
        except BaseException:
            # the next step assumed this one committed; the host state says it did not, so the
            # next schedule() recomputes from the host state instead
            self._inflight = None
            raise
        if self._inflight is not None and all(r.is_finished for r in self._inflight[0]):
            self._inflight = None  # every request of the next step has stopped: nothing to read
        self._account(run_out)
        if not stream:
            return self._pop_finished_outputs() + self._count_new_tokens(reqs)
        return self._pop_finished_outputs() + self._outputs_of(reqs)

    def _launch_next(self, sched_out: SchedulerOutput, reqs: list[Request], launched):
        """Launch the step after `launched` before reading it back -> (its requests, the launched
        step) or None: the same requests' next decode step from its device output; else (without
        mixed prefill) the prefill step of waiting requests, which does not need its tokens (also
        behind a prefill in flight); else, after a step that verified no drafts (a prefill launched
        ahead), the uniform step in which its requests join the running ones (their tokens copied
        from its device output)."""
        if self.runner.can_continue(launched):
            nxt = self.scheduler.schedule_continuation(sched_out, reqs, self.max_model_len)
            if nxt is not None:
                launched_next = self.runner.launch_continuation(launched, nxt)
                if launched_next is None:
                    return None
                self.scheduler.count_decode_step()
                return [r for r in reqs if not r.is_finished], launched_next  # stopped ones left out
            completing = []
        elif self.runner.can_join(launched):  # e.g. a prefill: the prompts it ends are not waiting on it
            completing = [r for sr, r in zip(sched_out.requests, reqs) if sr.sample]
        else:
            return None
        ahead = self.scheduler.schedule_prefill_ahead(completing)
        if ahead is not None:
            return [self._requests[sr.request_id] for sr in ahead.requests], self.runner.launch(ahead)
        if not self.runner.can_join(launched):
            return None
        join = self.scheduler.schedule_join(sched_out, reqs, self.runner.num_speculative_tokens, self.max_model_len)
        launched_join = None if join is None else self.runner.launch_join(launched, join)
        if launched_join is None:
            return None
        self.scheduler.count_decode_step()
        return [self._requests[sr.request_id] for sr in join.requests], launched_join

    def _commit(self, sched_out: SchedulerOutput, reqs: list[Request], run_out: ModelRunnerOutput) -> None:
        """Apply a step's output to its requests (`reqs`, the Request objects of sched_out's rows:
        an id may be reused by a new request while an async step of the old one is in flight)."""
        for sr, req in zip(sched_out.requests, reqs):
            if req.is_finished:  # stopped or aborted while this step ran (async scheduling)
                continue
            if sr.prompt_logprob_token_ids:  # in order: the scheduler scores what follows the known ones
                req.prompt_logprobs += run_out.prompt_logprobs[sr.request_id]
            if not sr.sample:
                req.num_computed_tokens += len(sr.token_ids)
                self.scheduler.cache_computed(req)
                continue
            rid = sr.request_id
            accepted = run_out.num_accepted.get(rid, 0)
            if sr.num_spec_tokens:
                self._record_drafts(req, sr.num_spec_tokens, accepted)
            # the committed rows: everything before the drafts, plus the accepted drafts
            req.num_computed_tokens += len(sr.token_ids) - sr.num_spec_tokens + accepted
            req.spec_token_ids = []
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            self._append_tokens(req, run_out.sampled_token_ids[rid], run_out.logprobs.get(rid))
            if not req.is_finished:  # a finished request's pages were offered when freed
                self.scheduler.cache_computed(req)
            drafts = run_out.draft_token_ids.get(rid)
            if drafts and not req.is_finished:
                req.spec_token_ids = self._trim_drafts(req, drafts)
                if req.grammar is not None:  # the tokens its grammar forces replace the drafter's there
                    req.spec_token_ids = req.grammar.steer_drafts(req.spec_token_ids)

    def _record_drafts(self, req: Request, num_drafts: int, accepted: int) -> None:
        """Count a verify step (before its tokens are appended) in the request's and the engine's
        speculative metrics.

        Only drafts that could be emitted before max_tokens count (drafts past it are verified, to
        keep steps uniform, but are not the drafter's merit).
        """
        countable = max(0, req.sampling_params.max_output_tokens - len(req.output_token_ids) - 1)
        drafted, counted = min(num_drafts, countable), min(accepted, countable)
        req.spec_stats.record(drafted, counted)
        self.stats.spec.record(drafted, counted)

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list[dict] | None) -> None:
        """Commit tokens, stopping exactly at the first stop condition.

        Per token, in this order: a completed stop string, EOS (unless ignore_eos), a stop token
        id, the token that completes a structured-output grammar (finish_reason "stop", stop_reason
        None; the grammar state advances over the committed tokens), then max_tokens /
        max_model_len. `req.stop_reason` (vLLM's): the stop string or stop token id that ended the
        request; None for the tokenizer's EOS (also when listed in stop_token_ids, as vLLM checks
        EOS first; every EOS id when the tokenizer names none of them), for a completed grammar and
        for length; the id of another of the model's EOS ids (vLLM puts generation_config's extra
        eos ids among the stop token ids). The token-id and length
        limits are found first, so only the detokenizer runs per token; the tokens are then
        committed as one slice.
        As in vLLM, the EOS or stop token id that ends the request is not detokenized (it adds no
        text, and cannot complete a stop string) unless include_stop_str_in_output.
        """
        params = req.sampling_params
        # tokens that fit; the first is committed even without room (the length check follows it)
        room = max(1, min(params.max_output_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens))
        end = min(len(tokens), room)
        reason, stop_reason = ("length" if end == room else None), None
        masked = None  # the position a fully masked row sampled, if any
        if req.token_mask is not None:
            masked = self._first_masked(req, tokens, end)
            if masked is not None:
                end, reason = masked, "abort"
        if req.grammar is not None:
            end, reason = self._advance_grammar(req, tokens, end, reason)
        stop_ids = self._stop_ids[req.request_id]
        text_end = end  # tokens that reach the detokenizer
        if stop_ids:
            for i in range(end):
                if tokens[i] in stop_ids:
                    # vLLM: the EOS check comes first and records no stop_reason; a stop_token_ids hit records the id
                    eos = not params.ignore_eos and tokens[i] in req.eos_token_ids
                    # only the tokenizer's EOS: vLLM puts the model's other eos ids among the stop ids
                    primary = getattr(self.tokenizer, "eos_token_id", None)
                    eos = eos and (tokens[i] == primary or primary not in req.eos_token_ids)
                    end, reason, stop_reason = i + 1, "stop", None if eos else tokens[i]
                    text_end = end if params.include_stop_str_in_output else i  # vLLM: no text for the stop token
                    break
        hit = self._detok[req.request_id].extend(tokens[:text_end])
        if hit is not None:
            end, reason, stop_reason = hit[0] + 1, "stop", hit[1]
        req.output_token_ids += tokens[:end]
        if logprobs:
            req.logprobs += logprobs[:end]
        self._num_new[req.request_id] = self._num_new.get(req.request_id, 0) + end
        if reason is not None:
            if reason == "abort" and end == masked:  # not when an earlier stop or the grammar's end came first
                logger.warning("request %s: every token of output position %d is masked (allowed_token_ids / "
                               "bad_words, min_tokens, a grammar); ending it (finish_reason abort)",
                               req.request_id, len(req.output_token_ids))  # the tokens before it are committed
            req.stop_reason = stop_reason
            self._finish(req, reason)

    def _first_masked(self, req: Request, tokens: list[int], end: int) -> int | None:
        """The index of the first of tokens[:end] that `req`'s allowed_token_ids / bad_words forbid,
        or of an EOS / stop id below min_tokens, or None: such a token was sampled from a row whose
        every token was masked (RequestTokenMask.first_disallowed), and the request ends before it
        (finish_reason "abort", logged without its text), so the output never holds it."""
        n = req.token_mask.first_disallowed(req.output_token_ids, tokens[:end])
        params = req.sampling_params
        short = max(0, min(end, params.min_tokens - len(req.output_token_ids)))  # positions min_tokens masks
        if short:  # min_tokens masks the EOS ids (also with ignore_eos, as vLLM) and stop ids below it
            stops = set(req.eos_token_ids).union(params.stop_token_ids or ())
            n = next((i for i in range(short if n is None else min(n, short)) if tokens[i] in stops), n)
        return n

    def _advance_grammar(self, req: Request, tokens: list[int], end: int, reason: str | None) -> tuple[int, str | None]:
        """Advance `req`'s grammar over tokens[:end] -> (end, reason): cut after the token that
        completes it ("stop"), or before one it refuses ("abort", logged without its text: a row
        whose every allowed token was masked, e.g. by min_tokens, samples one, and llguidance
        refuses the special token it allows for a grammar that spells that token's text)."""
        n, complete = req.grammar.advance(tokens[:end])
        if complete:
            return n, "stop"
        if n < end:
            logger.warning("request %s: output token id %d (position %d) breaks its structured-output grammar; "
                           "ending it (finish_reason abort)", req.request_id, tokens[n], len(req.output_token_ids) + n)
            return n, "abort"
        return end, reason

    def _trim_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """Drop drafts that would not fit the context (max_model_len).

        Drafts past max_tokens are kept, as in vLLM: `_append_tokens` stops at max_tokens exactly,
        and a step that keeps all K drafts stays uniform, so it replays a CUDA graph instead of
        running eagerly (trimming made the last K steps of every request eager).
        """
        room = self.max_model_len - req.num_tokens
        return list(drafts[: max(0, room - 1)])

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.scheduler.finish(req)
        self._detok[req.request_id].flush()
        self._finished_unreported.append(req)

    def _account(self, run_out: ModelRunnerOutput) -> None:
        self.stats.num_steps += 1
        self.stats.forward_time_s += run_out.forward_time_s
        self.stats.draft_time_s += run_out.draft_time_s

    def _outputs_of(self, reqs: list[Request]) -> list[RequestOutput]:
        return [self._output(r) for r in reqs if not r.is_finished and self._num_new.get(r.request_id)]

    def _count_new_tokens(self, reqs: list[Request]) -> list[RequestOutput]:
        """The bookkeeping of `_outputs_of` without the outputs (stream=False) -> []."""
        for req in reqs:
            if not req.is_finished:
                self.stats.num_generated_tokens += self._num_new.pop(req.request_id, 0)
        return []

    def _pop_finished_outputs(self) -> list[RequestOutput]:
        done, self._finished_unreported = self._finished_unreported, []
        outs = [self._output(r) for r in done]
        for r in done:
            self._requests.pop(r.request_id, None)
            self._detok.pop(r.request_id, None)
            self._stop_ids.pop(r.request_id, None)
        return outs

    def _output(self, req: Request) -> RequestOutput:
        num_new = self._num_new.pop(req.request_id, 0)
        self.stats.num_generated_tokens += num_new
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self._detok[req.request_id].text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            spec=req.spec_stats,
            ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            latency_s=None if req.finish_time is None else req.finish_time - req.arrival_time,
            logprobs=list(req.logprobs) if req.sampling_params.logprobs is not None else None,
            num_new_tokens=num_new,
            prompt_logprobs=list(req.prompt_logprobs) if req.sampling_params.prompt_logprobs is not None else None,
            num_cached_tokens=req.num_cached_tokens or 0,  # None: never admitted (aborted while waiting)
        )
