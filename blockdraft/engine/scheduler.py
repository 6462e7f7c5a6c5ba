"""Continuous batching with a token budget, chunked prefill and preemption by recomputation.

Each step: running requests first (oldest first), each asking for its uncomputed tokens plus its
drafts; then waiting requests while budget, sequence slots and pages last. When pages run out, the
newest running request is preempted: its pages are freed and it goes back to the front of the
waiting queue with `num_computed_tokens = 0`, so its prompt and output so far are recomputed as a
prefill (the tokens it already produced are kept, so nothing is lost and no token changes).

Without mixed prefill (SchedulerConfig.mixed_prefill False, the default where CUDA graphs are
captured) a step either prefills or decodes, prefill first (`schedule`), and a further waiting
prompt joins a prefill step only whole and within SchedulerConfig.max_prefill_tokens rows /
max_prefill_seqs requests (the largest prefill graph), so a burst of arrivals prefills in graphed
steps; the step's first prompt is chunked by the token budget alone.

Admission batching (without mixed prefill): every prefill step pauses all decoding requests for a
forward, and DFlash requests finish ~3x sooner than plain ones, so admitting each arrival at once
makes nearly every other step a prefill under a steady load. With
SchedulerConfig.admission_batch_ratio r > 0, while requests run, waiting requests are admitted
only once at least max(1, ceil(r x running)) of them (at most max_prefill_seqs, what one prefill
step takes) fit the free sequence slots, or once admission has been deferred for
admission_max_wait_steps launched decode steps (as text-generation-inference's
--waiting-served-ratio / --max-waiting-tokens trade a few steps of time to first token for fewer
prefill pauses). Admitted at once: anything with nothing running, a preempted request (its KV is
gone), and those a full prefill step left waiting.

Prefix caching (KVCacheManager(enable_prefix_caching=True)): a waiting request with nothing
computed starts from its longest cached prefix of full pages (never its last token), so its first
step is a prefill chunk at start_position > 0, as chunked prefill already runs (not a request
asking for prompt log-probabilities it has not got yet: every prompt row's logits are needed, so it
recomputes its prompt, as in vLLM; `_add_prompt_logprob_rows` marks the rows). Pages are offered
to the cache by `cache_computed` after each committed step, and before they are freed
(finish, preemption), so a preempted request's pages stay cached for its readmission. The hit
of a request's first admission, in tokens, is kept in `Request.num_cached_tokens`
(RequestOutput.num_cached_tokens); a readmission does not change it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection

import torch

from blockdraft.config import SchedulerConfig
from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.outputs import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from blockdraft.engine.request import Request, RequestStatus


class Scheduler:
    """Decides which tokens of which requests the next forward computes.

    Invariant: a request is in `running` iff its status is RUNNING and in `waiting` iff it is
    WAITING (so membership is read from the status, not by scanning the queues).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._decode_owed = False  # without mixed prefill: the last step computed a non-final prompt chunk
        self._admission_wait = 0  # decode steps launched while admissible requests were held back
        self.num_preemptions = 0  # since the start (vLLM's num_preemptions metric): requests sent back to wait

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never fit in the KV pool."""
        need = self.kv.blocks_needed(request.num_tokens + 1)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs {need} KV pages but the pool has only "
                f"{self.kv.num_blocks} (raise num_kv_blocks or kv_block_size)"
            )
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch (may preempt running requests to make room).

        With `config.mixed_prefill` off, a step that can prefill does only that: the running
        requests still computing their prompt (`is_prefilling`: a chunked prompt, a prefix hit,
        one readmitted after preemption) and the waiting requests admitted now, leaving free the
        pages the decoding requests need for their next rows (else the next decode step would
        preempt what was just admitted); the decoding requests wait one step. After a step that
        computed a prompt's non-final chunk, the decoding requests get the next step, so a long
        prompt interleaves with decode steps instead of stalling them for all its chunks.
        Otherwise (nothing to prefill, or no page or slot for it) the step decodes every running
        request, so a step of Q rows per request stays uniform (CUDA graphs).
        """
        if self.config.mixed_prefill:
            return self._schedule(self.running, admit=True)
        prefilling, decoding = [], []
        for r in self.running:  # one pass: this runs every step
            (prefilling if is_prefilling(r) else decoding).append(r)
        preempted: list[str] = []
        can_admit = self._admission_open()
        if (prefilling or can_admit) and not (self._decode_owed and decoding):
            so = self._schedule(prefilling, admit=True, reserve=self._decode_reserve(decoding), limit_prefill=True)
            if so.requests:
                self._decode_owed = any(not sr.sample for sr in so.requests)
                return so
            preempted = so.preempted_request_ids
        self._decode_owed = False
        so = self._schedule([r for r in decoding if r.status is RequestStatus.RUNNING], admit=False)
        so.preempted_request_ids[:0] = preempted
        if so.requests:
            self.count_decode_step()
        return so

    def _admissible(self) -> int:
        """Waiting requests the free sequence slots would take now (pages not considered)."""
        return min(len(self.waiting), self.config.max_num_seqs - len(self.running))

    def _admission_open(self) -> bool:
        """Whether waiting requests may be admitted now (see the module docstring's admission
        batching): a free slot and a waiting request, and with admission_batch_ratio r > 0 (no
        mixed prefill) at least min(max(1, ceil(r x running)), max_prefill_seqs) admissible or the
        wait used up."""
        n = self._admissible()
        if n <= 0:
            return False
        cfg = self.config
        # a preempted request at the head is a readmission: its KV is gone, do not hold it back
        if cfg.mixed_prefill or cfg.admission_batch_ratio == 0 or self.waiting[0].num_preemptions:
            return True
        need = max(1, math.ceil(cfg.admission_batch_ratio * len(self.running)))
        if cfg.max_prefill_seqs is not None:  # no more than one prefill step (graph) takes
            need = min(need, cfg.max_prefill_seqs)
        return n >= need or self._admission_wait >= cfg.admission_max_wait_steps

    def count_decode_step(self) -> None:
        """A decode step was launched (`schedule` counts its own; the engine counts the
        continuations and joins it launches): one more step of admission wait if a request could
        have been admitted instead, else the wait starts over."""
        self._admission_wait = self._admission_wait + 1 if self._admissible() > 0 else 0

    def _schedule(self, candidates: list[Request], admit: bool, reserve: int = 0,
                  limit_prefill: bool = False) -> SchedulerOutput:
        """Running `candidates` in order (preempting the newest running requests when pages run
        out), then, with `admit` and no preemption, waiting requests while budget lasts and more
        than `reserve` pages stay free (and, with `limit_prefill`, within the prefill step limits)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        for req in list(candidates):
            # status, not `req in self.running`: a scan of the batch per request (quadratic)
            if req.status is not RequestStatus.RUNNING or budget == 0:  # preempted above, or no budget
                continue
            num_new = self._fit_running(req, budget)
            while not self.kv.allocate_slots(req, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
        if admit and not preempted:
            self._admit_waiting(budget, scheduled, reserve, limit_prefill)
        return SchedulerOutput(requests=scheduled, preempted_request_ids=preempted)

    def schedule_continuation(self, so: SchedulerOutput, requests: list[Request],
                              max_model_len: int) -> SchedulerOutput | None:
        """The step after `so` for its requests still running, scheduled before `so`'s tokens are known.

        Async scheduling: `so` is in flight and every committed step before it is applied, so each
        request's `num_computed_tokens` is the start of its rows in `so`. `so` must be uniform (every
        request samples after Q = 1 + K rows). The next step gives each request Q rows again: the
        bonus token and K drafts that the runner takes from `so`'s output on the device, written
        here as PLACEHOLDER_TOKEN. Pages are allocated for the longest outcome (all K drafts of `so`
        accepted: 2Q tokens past the start). Requests of `so` that have stopped or been aborted
        since are left out (the runner gathers the others' rows).

        Args:
            so: the step in flight. requests: the Request of each of its rows (by object: a
                stopped request's id may already belong to a newer request).
            max_model_len: the context limit in tokens.
        Returns None (nothing scheduled; pages may have grown, which later steps use) when the batch
        would change otherwise: waiting requests may be admitted (`_admission_open`), a
        running request is not in `so`, none of `so`'s requests is still running, `so` is not
        uniform, the longest outcome would not leave room for K drafts within `max_model_len`, or
        the pool is out of pages (no preemption here).
        """
        if self._admission_open() or not so.requests or not self.running:
            return None
        q = len(so.requests[0].token_ids)
        scheduled, i = [], 0
        for sr, req in zip(so.requests, requests, strict=True):
            if not sr.sample or len(sr.token_ids) != q or sr.num_spec_tokens != q - 1:
                return None
            if req.is_finished:
                continue  # stopped or aborted since `so` was scheduled
            if i >= len(self.running) or self.running[i] is not req:
                return None
            i += 1
            need = req.num_computed_tokens + 2 * q
            # +1: the engine trims drafts that would end past max_model_len; none may be trimmed here
            if need + 1 > max_model_len or not self.kv.allocate_slots(req, need):
                return None
            scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=[PLACEHOLDER_TOKEN] * q,
                start_position=-1,
                num_spec_tokens=q - 1,
                sample=True,
                block_ids=list(req.block_ids),
                sampling_params=req.sampling_params,
                token_mask=req.token_mask,  # a static one: a mask that reads the output is not continued
            ))
        if i != len(self.running):
            return None
        return SchedulerOutput(requests=scheduled)

    def schedule_join(self, so: SchedulerOutput, requests: list[Request], num_spec_tokens: int,
                      max_model_len: int) -> SchedulerOutput | None:
        """The uniform step of every running request, scheduled while `so` is in flight and before
        its tokens are known, when `so` verified no drafts (async scheduling).

        `so` (typically a prefill step launched ahead of reading a decode step back) must have
        every request sample one token from its last row with no drafts to verify, so each of its
        requests' next rows are known on the host except for their tokens: Q = 1 + K rows at
        position `num_tokens` onwards (the token `so` samples, then the K drafts it proposes), written
        here as PLACEHOLDER_TOKEN (the runner copies them from `so`'s device output). Every other
        running request must have its step before committed, one uncomputed token and exactly K
        drafts (`num_spec_tokens`), as `schedule` would schedule it. Requests of `so` that are no
        longer running (stopped, aborted) are left out. The step is what `schedule` would return
        after `so` is committed, in the same order, unless `so`'s own stops change the batch.

        Args:
            so: the step in flight. requests: the Request of each of its rows (by object, as in
                `schedule_continuation`). num_spec_tokens: K. max_model_len: the context limit.
        Returns None (nothing scheduled; pages may have grown, which later steps use) when nothing
        is running, waiting requests may be admitted (`_admission_open`), a request of `so`
        verifies drafts or does not sample, another running request is not ready as above, the
        step exceeds the token budget, a request of `so` would need its drafts trimmed to
        `max_model_len`, or the pool is out of pages (no preemption here).
        """
        q = num_spec_tokens + 1
        if self._admission_open() or not so.requests or len(self.running) * q > self.config.max_num_batched_tokens:
            return None
        in_flight = set()
        for sr, req in zip(so.requests, requests, strict=True):
            if not sr.sample or sr.num_spec_tokens:
                return None
            in_flight.add(id(req))
        scheduled = []
        for req in self.running:
            if id(req) in in_flight:
                start = req.num_tokens  # `so` computes up to here and samples the token at `start`
                # +1: the engine trims drafts that would end past max_model_len; none may be trimmed here
                if start + q + 1 > max_model_len or not self.kv.allocate_slots(req, start + q):
                    return None
                scheduled.append(ScheduledRequest(
                    request_id=req.request_id, token_ids=[PLACEHOLDER_TOKEN] * q, start_position=start,
                    num_spec_tokens=num_spec_tokens, sample=True, block_ids=list(req.block_ids),
                    sampling_params=req.sampling_params, token_mask=req.token_mask,  # static, as above
                ))  # fmt: skip
                continue
            if req.num_tokens - req.num_computed_tokens != 1 or len(req.spec_token_ids) != num_spec_tokens:
                return None
            if not self.kv.allocate_slots(req, req.num_computed_tokens + q):
                return None
            scheduled.append(self._scheduled(req, q))
        return SchedulerOutput(requests=scheduled) if scheduled else None

    def schedule_prefill_ahead(self, completing: Collection[Request] = ()) -> SchedulerOutput | None:
        """Without mixed prefill: the prefill step of the waiting requests, scheduled while the
        running requests' decode step (or another prefill step) is in flight and not yet committed
        (async scheduling), or None.

        It does not depend on that step (other requests, and no page it holds), so the engine
        launches it before reading the step back instead of leaving the GPU idle meanwhile.
        Admissions only, as `schedule` would make them (budget, sequence slots, pages, the prefill
        step limits; no preemption). None with mixed prefill on, while a running request is still
        prefilling (the next `schedule` takes it with the waiting ones) other than the
        `completing` ones, whose prompts the step in flight computes to the end, or when nothing
        can be admitted.
        """
        if self.config.mixed_prefill or not self._admission_open():
            return None
        done = {id(r) for r in completing}
        if any(is_prefilling(r) and id(r) not in done for r in self.running):
            return None
        scheduled: list[ScheduledRequest] = []
        # the decode step in flight is not committed: reserve for it and the step after it
        self._admit_waiting(self.config.max_num_batched_tokens, scheduled, self._decode_reserve(self.running, 2),
                            limit_prefill=True)
        if not scheduled:
            return None
        self._decode_owed = any(not sr.sample for sr in scheduled)
        return SchedulerOutput(requests=scheduled)

    def _decode_reserve(self, decoding: list[Request], steps: int = 1) -> int:
        """Pages the decoding requests still need for their next `steps` steps' rows (at most
        1 + K tokens each: a request whose drafts a step trimmed drafts K again)."""
        k = self.config.num_speculative_tokens
        return sum(max(0, self.kv.blocks_needed(r.num_tokens + steps * (1 + max(k, len(r.spec_token_ids))) - 1)
                       - len(r.block_ids)) for r in decoding)

    def _fit_running(self, req: Request, budget: int) -> int:
        """Tokens to compute for a running request; trims drafts that do not fit the budget."""
        uncomputed = req.num_tokens - req.num_computed_tokens
        if uncomputed + len(req.spec_token_ids) > budget:
            del req.spec_token_ids[max(0, budget - uncomputed) :]
        return min(uncomputed + len(req.spec_token_ids), budget)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest], reserve: int = 0,
                       limit_prefill: bool = False) -> int:
        """Admit waiting requests in order while budget, sequence slots and pages last, leaving
        `reserve` pages free -> the budget left. With `limit_prefill` (a prefill-only step), a request
        joins a step that already has one only within max_prefill_seqs requests and, when
        max_prefill_tokens is set, whole and within max_prefill_tokens rows."""
        max_rows, max_reqs = self.config.max_prefill_tokens, self.config.max_prefill_seqs
        rows = sum(len(sr.token_ids) for sr in scheduled)
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if limit_prefill and scheduled and max_reqs is not None and len(scheduled) >= max_reqs:
                break
            req = self.waiting[0]
            hit = self._take_prefix_hit(req)
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, budget)
            extra = self.kv.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_ids)
            # joining others: whole prompts only (a non-final chunk makes the step run eagerly)
            over_limit = (limit_prefill and scheduled and max_rows is not None
                          and (rows + num_new > max_rows or num_new < remaining))
            if over_limit or extra > self.kv.num_free_blocks - reserve or not self.kv.allocate_slots(
                req, req.num_computed_tokens + num_new
            ):
                if hit:  # give the hit back (its pages stay cached); retried next step
                    self.kv.free(req)
                    req.num_computed_tokens = 0
                break
            if hit is not None:
                self.kv.record_lookup(req.num_tokens, req.num_computed_tokens)
            if req.num_cached_tokens is None:  # first admission only: kept over preemption
                req.num_cached_tokens = hit or 0
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            rows += num_new
            admitted = True
        if admitted:  # those a full prefill step left waiting stay admissible: the gate stays open
            self._admission_wait = self.config.admission_max_wait_steps if self._admissible() > 0 else 0
        return budget

    def _take_prefix_hit(self, req: Request) -> int | None:
        """Start a request with nothing computed from its cached prefix -> the hit in tokens (0: a
        miss), or None when no lookup was made (caching off, the request has computed tokens, or it
        asks for prompt log-probabilities not computed yet: they need the logits of every prompt
        row, so its prompt is recomputed, as in vLLM)."""
        if not self.kv.enable_prefix_caching or req.num_computed_tokens or req.block_ids or req.needs_prompt_logprobs:
            return None
        pages = self.kv.find_cached_prefix(req)
        self.kv.take_cached(req, pages)
        req.num_computed_tokens = len(pages) * self.kv.kv_block_size
        return req.num_computed_tokens

    def cache_computed(self, req: Request) -> None:
        """Offer the request's full, committed pages to the prefix cache (no-op when it is off).
        Call after a step's tokens are committed (num_computed_tokens and output tokens updated)."""
        self.kv.cache_full_pages(req, req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache_computed(req)
        self.kv.free(req)
        req.num_recompute_tokens = req.num_tokens
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        token_ids = req.token_slice(start, start + num_new)
        reaches_end = start + num_new == req.num_tokens + len(req.spec_token_ids)
        sr = ScheduledRequest(
            request_id=req.request_id,
            token_ids=token_ids,
            start_position=start,
            num_spec_tokens=len(req.spec_token_ids) if reaches_end else 0,
            sample=reaches_end,
            block_ids=list(req.block_ids),
            sampling_params=req.sampling_params,
            logits_context=_logits_context(req) if reaches_end and req.sampling_params.adjusts_logits else None,
            grammar=req.grammar if reaches_end else None,
            token_mask=req.token_mask if reaches_end else None,
            output_token_ids=req.output_token_ids if reaches_end and _mask_reads_output(req) else (),
        )
        if req.needs_prompt_logprobs:
            _add_prompt_logprob_rows(sr, req)
        return sr

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free its pages."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.cache_computed(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED


def _logits_context(req: Request) -> tuple[torch.Tensor | None, list[int], tuple[int, ...]]:
    """ScheduledRequest.logits_context of a request that samples this step (the prompt's token set
    only when the repetition penalty reads it)."""
    params = req.sampling_params
    masked: tuple[int, ...] = ()
    if len(req.output_token_ids) < params.min_tokens:
        # every EOS id even with ignore_eos, as vLLM (its min-tokens processor masks all_stop_token_ids)
        masked = tuple(params.stop_token_ids) + tuple(req.eos_token_ids)
    prompt = req.prompt_token_set() if params.repetition_penalty != 1.0 else None
    return prompt, req.output_token_ids, masked


def _mask_reads_output(req: Request) -> bool:
    """Whether the request's token mask (allowed_token_ids / bad_words) depends on its output tokens."""
    return req.token_mask is not None and req.token_mask.reads_output


def _add_prompt_logprob_rows(sr: ScheduledRequest, req: Request) -> None:
    """Set the prompt tokens `sr` scores (ScheduledRequest.prompt_logprob_token_ids): those after
    the ones already scored (`req.prompt_logprobs`, which a recomputation after preemption keeps)
    whose predecessor's row is in `sr`: rows at positions a..b-1 score prompt[a + 1 : b + 1]."""
    prompt = req.prompt_token_ids
    a = max(sr.start_position, len(req.prompt_logprobs) - 1)
    b = min(sr.start_position + len(sr.token_ids), len(prompt) - 1)
    if a < b:
        sr.prompt_logprob_token_ids = prompt[a + 1 : b + 1]
        sr.prompt_logprob_offset = a - sr.start_position


def is_prefilling(req: Request) -> bool:
    """Whether a running request is still computing its prompt (or, readmitted after
    preemption, its prompt and output so far): more than its last token uncomputed, or less
    computed than that (a prompt or recompute cut one token short by the budget)."""
    target = max(len(req.prompt_token_ids), req.num_recompute_tokens)
    return req.num_tokens - req.num_computed_tokens > 1 or req.num_computed_tokens < target


def check_admission_settings(ratio: float | None, max_wait_steps: int | None) -> None:
    """Raise ValueError (naming the parameter) for an admission_batch_ratio / _max_wait_steps that
    SchedulerConfig would refuse; None means "the default". For tools that build engines late."""
    given = {k: v for k, v in (("admission_batch_ratio", ratio), ("admission_max_wait_steps", max_wait_steps))
             if v is not None}
    SchedulerConfig(**given)
