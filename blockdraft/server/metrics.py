"""Prometheus metrics of the server, in their own registry (several servers can live in one process).

Counters and histograms are updated in the engine thread right after each step, before the step's
outputs reach any client, so a client that has its final response also sees it counted in /metrics.

Names (all prefixed `blockdraft_`):
    requests_total{finish_reason}          finished engine requests (one per choice; "abort" = client left)
    prompt_tokens_total / generation_tokens_total
    time_to_first_token_seconds            arrival of the HTTP request -> first output token
    inter_token_latency_seconds            gap between outputs / tokens in the output, once per token
    request_latency_seconds                arrival -> finish
    spec_decode_num_drafts_total           verify steps that carried drafts
    spec_decode_num_draft_tokens_total / spec_decode_num_accepted_tokens_total
    spec_decode_num_accepted_tokens_per_pos_total{position}   steps whose draft `position` (1-based) was accepted
    spec_decode_num_drafts_per_pos_total{position}   steps that drafted `position` (>= position drafts); the
                                           acceptance rate at a position is accepted_tokens_per_pos / this
                                           (not / num_drafts: a step near max_tokens drafts fewer than K)
    kv_cache_usage_ratio, kv_cache_free_blocks, kv_cache_total_blocks
    prefix_cache_queries_total / prefix_cache_hits_total   tokens looked up in / served from the
                                           prefix cache at admission (0 unless --enable-prefix-caching)
    num_requests_running, num_requests_waiting
    http_errors_total{status}              requests answered with an error status
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The server's metrics. `on_added` / `on_step` run in the engine thread only."""

    def __init__(self, num_speculative_tokens: int = 0) -> None:
        """num_speculative_tokens: the server's K (0: no drafter). The per-position series of
        positions 1..K exist from the start at 0, as vLLM's do, so a rate's numerator and
        denominator are both there before a position's first acceptance."""
        r = self.registry = CollectorRegistry()
        p = "blockdraft_"
        self.requests = Counter(p + "requests", "Finished engine requests (one per choice).", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests (n choices count n times).", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Output tokens generated.", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Request arrival to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Seconds per output token after the first.", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(p + "request_latency_seconds", "Request arrival to finish.", buckets=_E2E_BUCKETS, registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verify steps that carried drafts.", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Verify steps whose draft at this 1-based position was accepted.",
            ["position"], registry=r,
        )
        self.drafts_per_pos = Counter(  # the per-position denominator: cut blocks never drafted the later positions
            p + "spec_decode_num_drafts_per_pos", "Verify steps that drafted this 1-based position.",
            ["position"], registry=r,
        )
        for position in range(1, num_speculative_tokens + 1):
            self.accepted_per_pos.labels(position=str(position))
            self.drafts_per_pos.labels(position=str(position))
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV pages in use.", registry=r)
        self.kv_free = Gauge(p + "kv_cache_free_blocks", "Free KV pages.", registry=r)
        self.kv_total = Gauge(p + "kv_cache_total_blocks", "KV pages in the pool.", registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Tokens looked up in the prefix cache at admission.", registry=r
        )
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Tokens whose KV came from the prefix cache.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being decoded.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued (no KV pages or batch slot yet).", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted (KV pages freed, recomputed later).",
                                   registry=r)
        self._preemptions_seen = 0
        self.http_errors = Counter(p + "http_errors", "Requests answered with an error.", ["status"], registry=r)
        self._arrival: dict[str, float] = {}  # request id -> arrival (perf_counter seconds)
        self._last_token: dict[str, float] = {}  # request id -> when its latest tokens came out
        self._prefix_seen = (0, 0)  # kv.stats at the last step: queries, hits (tokens)
        # engine.stats.spec at the last step: steps, drafted, accepted, accepted and drafted per position
        self._spec_seen = (0, 0, 0, [], [])

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def on_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def on_added(self, request_id: str, num_prompt_tokens: int, arrival: float) -> None:
        self._arrival[request_id] = arrival
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, engine, outputs) -> None:
        """Account one engine step: token latencies, finished requests, spec counters, KV and queues."""
        now = time.perf_counter()
        for out in outputs:
            self._observe_tokens(out, now)
            if out.finished:
                self._observe_finish(out, now)
        self._observe_spec(engine.stats.spec)
        kv = engine.scheduler.kv
        self.kv_usage.set(kv.usage())
        self.kv_free.set(kv.num_free_blocks)
        self.kv_total.set(kv.num_blocks)
        self._observe_prefix_cache(kv.stats)
        self.running.set(len(engine.scheduler.running))
        self.preemptions.inc(engine.scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = engine.scheduler.num_preemptions
        self.waiting.set(len(engine.scheduler.waiting))

    def _observe_tokens(self, out, now: float) -> None:
        n = out.num_new_tokens
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        rid = out.request_id
        last = self._last_token.get(rid)
        if last is None:
            self.ttft.observe(now - self._arrival.get(rid, now))
            n -= 1  # the first token's latency is the TTFT; the rest of a speculative burst follows
            last = now
        for _ in range(n):
            self.itl.observe((now - last) / out.num_new_tokens)
        self._last_token[rid] = now

    def _observe_finish(self, out, now: float) -> None:
        self.requests.labels(finish_reason=out.finish_reason or "unknown").inc()
        arrival = self._arrival.pop(out.request_id, None)
        self._last_token.pop(out.request_id, None)
        if arrival is not None:
            self.e2e.observe(now - arrival)

    def _observe_prefix_cache(self, stats) -> None:
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(stats.queries - queries)
        self.prefix_hits.inc(stats.hits - hits)
        self._prefix_seen = (stats.queries, stats.hits)

    def _observe_spec(self, spec) -> None:
        steps, drafted, accepted, accepted_pos, drafted_pos = self._spec_seen
        self.drafts.inc(spec.num_steps - steps)
        self.draft_tokens.inc(spec.num_drafted_tokens - drafted)
        self.accepted_tokens.inc(spec.num_accepted_tokens - accepted)
        _inc_per_pos(self.accepted_per_pos, spec.accepted_per_position, accepted_pos)
        _inc_per_pos(self.drafts_per_pos, spec.drafted_per_position, drafted_pos)
        self._spec_seen = (spec.num_steps, spec.num_drafted_tokens, spec.num_accepted_tokens,
                           list(spec.accepted_per_position), list(spec.drafted_per_position))


def _inc_per_pos(counter: Counter, counts: list[int], before: list[int]) -> None:
    """Add to `counter{position}` what `counts` (0-based positions) gained since `before`."""
    for i, count in enumerate(counts):
        seen = before[i] if i < len(before) else 0
        if count > seen:
            counter.labels(position=str(i + 1)).inc(count - seen)
