"""SchedulerConfig.mixed_prefill: off, a step prefills (admitted and partly computed prompts) or
decodes, prefill first, so decode / verify steps stay uniform and replay their graphs while
requests arrive; the answers are the same token for token."""

import pytest

from blockdraft.config import SchedulerConfig
from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.request import Request, RequestStatus
from blockdraft.engine.scheduler import Scheduler
from blockdraft.llm import resolve_mixed_prefill
from blockdraft.runner.model_runner import ModelRunner
from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts, tiny_target
from tests.engine.test_async_scheduling import _oracle_speculator

GRAPHS = dict(attention_backend="dense", graph_mode="eager")


def _sched(mixed, budget=16, seqs=4, blocks=16, bs=4, **limits):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, mixed_prefill=mixed, **limits)
    return Scheduler(config, KVCacheManager(blocks, bs))


def _req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams())


def _decoding(s, rid, prompt_len, drafts=(8, 9)):
    """A running request whose prompt is computed and whose first token and drafts wait."""
    r = _req(rid, prompt_len)
    s.add_request(r)
    s.schedule()
    r.num_computed_tokens = prompt_len
    r.output_token_ids = [7]
    r.spec_token_ids = list(drafts)
    return r


def _rows(so):
    return [(sr.request_id, sr.start_position, len(sr.token_ids), sr.sample) for sr in so.requests]


@pytest.mark.parametrize("mixed", [True, False])
def test_a_new_prompt_joins_the_decode_step_only_with_mixed_prefill(mixed):
    s = _sched(mixed)
    a = _decoding(s, "a", 3)
    b = _req("b", 5)
    s.add_request(b)
    if mixed:
        assert _rows(s.schedule()) == [("a", 3, 3, True), ("b", 0, 5, True)]
        return
    assert _rows(s.schedule()) == [("b", 0, 5, True)]  # a waits one step with its drafts
    assert a.spec_token_ids == [8, 9]
    b.num_computed_tokens, b.output_token_ids, b.spec_token_ids = 5, [4], [5, 6]
    assert _rows(s.schedule()) == [("a", 3, 3, True), ("b", 5, 3, True)]


def test_without_mixed_prefill_a_long_prompts_chunks_take_turns_with_decoding():
    """A 20-token prompt at 8 tokens per step: each non-final chunk is followed by a decode step
    (a long prompt does not stall the running requests for all its chunks)."""
    s = _sched(False, budget=8, blocks=32)
    _decoding(s, "a", 3)
    b = _req("b", 20)
    s.add_request(b)
    steps = []
    for _ in range(5):
        so = s.schedule()
        steps.append(_rows(so))
        if so.requests[0].request_id == "b":
            b.num_computed_tokens += len(so.requests[0].token_ids)
    a_decodes = [("a", 3, 3, True)]
    assert steps == [[("b", 0, 8, False)], a_decodes, [("b", 8, 8, False)], a_decodes, [("b", 16, 4, True)]]
    b.output_token_ids = [4]  # b sampled: both decode now
    assert _rows(s.schedule()) == [("a", 3, 3, True), ("b", 20, 1, True)]


def test_a_prompt_cut_one_token_short_is_still_prefilling():
    """A 9-token prompt at 8 tokens per step leaves 1 token: that last token is a prefill (its own
    step), not a decode row that would make the decode step non-uniform."""
    s = _sched(False, budget=8, blocks=32)
    _decoding(s, "a", 3)
    b = _req("b", 9)
    s.add_request(b)
    assert _rows(s.schedule()) == [("b", 0, 8, False)]
    b.num_computed_tokens = 8
    assert _rows(s.schedule()) == [("a", 3, 3, True)]  # the decode turn after a non-final chunk
    assert _rows(s.schedule()) == [("b", 8, 1, True)]


def test_a_readmitted_request_is_prefilling_until_it_recomputed_its_output_so_far():
    from blockdraft.engine.scheduler import is_prefilling

    s = _sched(False, blocks=32)
    a = _decoding(s, "a", 3)
    a.output_token_ids = [7, 8, 9, 10]  # 3 prompt + 4 output tokens, then preempted
    s._preempt(a)
    a.status = RequestStatus.RUNNING
    a.num_computed_tokens = 6  # recomputed all but its last token: that one still prefills
    assert is_prefilling(a)
    a.num_computed_tokens, a.output_token_ids = 7, [7, 8, 9, 10, 11]  # the recompute sampled
    assert not is_prefilling(a)


def test_a_prefill_launched_ahead_reserves_the_pages_of_two_decode_steps():
    """a (3 prompt + 1 token, 2 drafts) holds 2 pages; the step in flight and the next one may
    need 4 + 2 x 3 - 1 = 9 tokens, 3 pages: b (2 pages) fits in a pool of 5, not of 4."""
    for blocks, want in ((4, None), (5, [("b", 0, 5, True)])):
        s = _sched(False, blocks=blocks)
        a = _decoding(s, "a", 3)
        s.kv.allocate_slots(a, 6)  # the decode step in flight took its pages
        s.add_request(_req("b", 5))
        got = s.schedule_prefill_ahead()
        assert (got if got is None else _rows(got)) == want


def test_without_mixed_prefill_admissions_leave_the_decoding_requests_their_next_pages():
    """Pages of 4 tokens, 3 in the pool: a holds 1 (3 tokens) and needs a second for its next 3
    rows, so b (5 tokens, 2 pages) waits rather than be preempted by a's next step."""
    s = _sched(False, blocks=3)
    _decoding(s, "a", 3)
    s.add_request(_req("b", 5))
    assert _rows(s.schedule()) == [("a", 3, 3, True)]  # 2 free - 1 reserved < 2 for b
    assert s.schedule_prefill_ahead() is None  # the same reserve
    s = _sched(False, blocks=4)
    _decoding(s, "a", 3)
    s.add_request(_req("b", 5))
    assert _rows(s.schedule()) == [("b", 0, 5, True)]  # 3 free - 1 reserved = 2 for b


def test_the_reserve_counts_k_drafts_for_a_request_whose_drafts_were_trimmed():
    """Pages of 4 tokens, 3 in the pool: a (3 prompt + 1 token) holds 1 page and its drafts were
    trimmed to fit the budget; its next step drafts K = 2 again (4 + 3 - 1 = 6 tokens, 2 pages), so
    b (5 tokens, 2 pages) waits. Counting only the drafts it holds now (none), b would take the pages
    and a's next step would preempt it."""
    s = _sched(False, blocks=3, num_speculative_tokens=2)
    _decoding(s, "a", 3, drafts=())
    s.add_request(_req("b", 5))
    assert _rows(s.schedule()) == [("a", 3, 1, True)]
    s = _sched(False, blocks=3)  # no speculator: a's next step is its one token, b fits
    _decoding(s, "a", 3, drafts=())
    s.add_request(_req("b", 5))
    assert _rows(s.schedule()) == [("b", 0, 5, True)]


def test_scheduler_config_refuses_a_negative_k():
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0, got -1"):
        SchedulerConfig(num_speculative_tokens=-1)


def test_without_mixed_prefill_a_prompt_that_cannot_start_does_not_stall_decoding():
    # no sequence slot: the running request decodes
    s = _sched(False, seqs=1)
    _decoding(s, "a", 3)
    s.add_request(_req("b", 5))
    assert _rows(s.schedule()) == [("a", 3, 3, True)]
    # no page for the waiting prompt (the pool holds a's pages only): a decodes, b waits
    s = _sched(False, blocks=2)
    _decoding(s, "a", 3)
    s.add_request(_req("b", 5))
    assert _rows(s.schedule()) == [("a", 3, 3, True)]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_without_mixed_prefill_a_prefill_step_stays_within_the_prefill_limits():
    """Arrivals of 5, 4, 3, 6 and 20 tokens, budget 32, at most 10 rows and 3 requests per
    prefill step: others join the first prompt only whole and within both limits; a prompt longer
    than the limit still starts a step of its own (chunked by the budget alone)."""
    s = _sched(False, budget=32, seqs=8, blocks=64, max_prefill_tokens=10, max_prefill_seqs=3)
    reqs = {rid: _req(rid, n) for rid, n in (("a", 5), ("b", 4), ("c", 3), ("d", 6), ("e", 20))}
    for r in reqs.values():
        s.add_request(r)

    def prefill_step():
        rows = _rows(s.schedule())
        for rid, *_ in rows:  # committed: the prompt computed, a first token sampled
            reqs[rid].num_computed_tokens, reqs[rid].output_token_ids = reqs[rid].num_tokens, [7]
        return rows

    assert prefill_step() == [("a", 0, 5, True), ("b", 0, 4, True)]  # c: 12 rows
    assert prefill_step() == [("c", 0, 3, True), ("d", 0, 6, True)]  # e: not whole within 10
    assert prefill_step() == [("e", 0, 20, True)]
    s = _sched(False, budget=32, seqs=8, blocks=64, max_prefill_tokens=100, max_prefill_seqs=3)
    for rid in "abcd":
        s.add_request(_req(rid, 2))
    assert [r[0] for r in _rows(s.schedule())] == ["a", "b", "c"]  # the request limit
    s = _sched(False, budget=16, seqs=8, blocks=64, max_prefill_tokens=16)
    for rid, n in (("a", 10), ("b", 10)):
        s.add_request(_req(rid, n))
    assert _rows(s.schedule()) == [("a", 0, 10, True)]  # b would join only as a 6-token chunk
    s = _sched(False, budget=16, seqs=8, blocks=64)  # no limits: b joins as a chunk, as before
    for rid, n in (("a", 10), ("b", 10)):
        s.add_request(_req(rid, n))
    assert _rows(s.schedule()) == [("a", 0, 10, True), ("b", 0, 6, False)]
    s = _sched(False, budget=32, seqs=8, blocks=64, max_prefill_tokens=100, max_prefill_seqs=2)
    _decoding(s, "x", 3)
    for rid in "abc":
        s.add_request(_req(rid, 2))
    assert [r[0] for r in _rows(s.schedule_prefill_ahead())] == ["a", "b"]  # launched ahead: the same limits
    with pytest.raises(ValueError, match="max_prefill_seqs must be None or an integer >= 1, got 0"):
        SchedulerConfig(max_prefill_seqs=0)
    with pytest.raises(ValueError, match="max_prefill_tokens must be None or an integer >= 1, got True"):
        SchedulerConfig(max_prefill_tokens=True)


@pytest.mark.parametrize("max_seqs, sizes, want", [
    (None, (10,), [("a", 32, 8, True)]),  # a's last 8-token chunk + 10 > 16 rows: b waits
    (2, (2, 2), [("a", 32, 8, True), ("b", 0, 2, True)]),  # a counts as one of the 2 requests
])
def test_a_running_prompt_still_prefilling_counts_toward_the_prefill_limits(max_seqs, sizes, want):
    s = _sched(False, budget=32, seqs=8, blocks=64, max_prefill_tokens=16, max_prefill_seqs=max_seqs)
    a = _req("a", 40)
    s.add_request(a)
    assert _rows(s.schedule()) == [("a", 0, 32, False)]
    a.num_computed_tokens = 32
    for rid, n in zip("bc", sizes):
        s.add_request(_req(rid, n))
    assert _rows(s.schedule()) == want


def test_the_engine_limits_prefill_steps_to_its_largest_prefill_graph(target):
    graphs = make_llm(target, mixed_prefill=False, max_num_seqs=6, **GRAPHS).engine.scheduler.config
    assert (graphs.max_prefill_tokens, graphs.max_prefill_seqs) == (512, 6)  # buckets up to the budget / seqs
    assert make_llm(target, max_num_batched_tokens=4096, mixed_prefill=False, **GRAPHS).engine.scheduler.config \
        .max_prefill_tokens == 1024
    for kw in ({"mixed_prefill": True, **GRAPHS}, {"mixed_prefill": False}):  # mixed steps / no graphs: no limit
        config = make_llm(target, **kw).engine.scheduler.config
        assert (config.max_prefill_tokens, config.max_prefill_seqs) == (None, None), kw


def test_mixed_prefill_resolves_from_whether_graphs_are_captured(target):
    assert resolve_mixed_prefill(None, graphs_captured=False) is True  # CPU, --enforce-eager, no graph fits
    assert resolve_mixed_prefill(None, graphs_captured=True) is False
    assert resolve_mixed_prefill(True, graphs_captured=True) is True
    assert resolve_mixed_prefill(False, graphs_captured=False) is False
    with pytest.raises(ValueError, match="mixed_prefill must be None, True or False, got 'no'"):
        resolve_mixed_prefill("no", graphs_captured=False)
    with pytest.raises(ValueError, match="mixed_prefill must be True or False, got 1"):
        SchedulerConfig(mixed_prefill=1)
    with pytest.raises(ValueError, match="mixed_prefill must be None, True or False, got 'on'"):
        make_llm(target, mixed_prefill="on")
    assert make_llm(target, **GRAPHS).engine.scheduler.config.mixed_prefill is True  # graphs built, not captured


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, logit_scale=8.0)


def _arrivals():
    """8 prompts of different lengths, greedy and seeded T > 0, some allowed to stop on a token id
    or EOS (so inside a draft block). With `_oracle_speculator` over `_plain_sequences` most
    drafts are accepted."""
    prompts = random_prompts(8, seed=21)
    stops = [{"ignore_eos": True}, {"stop_token_ids": [17]}, {}, {"ignore_eos": True}]
    params = [SamplingParams(max_tokens=[5, 17, 9, 30, 12, 3, 22, 8][i], temperature=0.9 * (i % 2), seed=i,
                             **stops[i % 4]) for i in range(8)]  # fmt: skip
    return prompts, params


def _plain_sequences(target, prompts, params):
    """Prompt + 60 plain tokens per request (same temperature and seed): the oracle's drafts."""
    long = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=p.temperature, seed=p.seed) for p in params]
    return [p + o.token_ids for p, o in zip(prompts, make_llm(target).generate(prompts, long))]


def _answers(llm, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


def _record_steps(monkeypatch, sizes=None):
    """Per launched step: (carries a request that sampled before, replays the uniform-step graphs);
    `sizes`, if given, gets each step's (requests, rows)."""
    steps, sampled = [], set()
    launch = ModelRunner.launch

    def recorded(self, so):
        ids = {sr.request_id for sr in so.requests}
        steps.append((bool(ids & sampled), self.graphs.target.padding_for(so) is not None))
        if sizes is not None:
            sizes.append((len(so.requests), so.total_num_tokens))
        sampled.update(sr.request_id for sr in so.requests if sr.sample)
        return launch(self, so)

    monkeypatch.setattr(ModelRunner, "launch", recorded)
    return steps


@pytest.mark.parametrize("k", [None, 1, 3], ids=["plain", "dflash-k1", "dflash-k3"])
def test_without_mixed_prefill_decode_steps_stay_uniform_as_requests_arrive(target, monkeypatch, k):
    """8 requests of different lengths, at most 3 running: each one that finishes lets the next
    in mid-decode. Without mixed prefill every step that carries decode rows is uniform (a graph
    replay on CUDA); with it some are not (the control). Answers and stops equal plain eager
    decoding, token for token, with most drafts accepted. Also under a 16-token step budget, where
    the prefill step limits (16 rows, the largest prefill graph) keep arrivals out of a step they
    would join as a chunk, and long prompts are chunked."""
    prompts, params = _arrivals()
    want = _answers(make_llm(target), prompts, params)
    assert any(reason == "stop" for _, reason in want)  # a stop inside a draft block is covered
    sequences = _plain_sequences(target, prompts, params)  # before any step is recorded

    sizes = []

    def run(mixed, budget=512):
        spec = None if k is None else _oracle_speculator(target, k, sequences)
        sizes.clear()
        steps = _record_steps(monkeypatch, sizes)
        llm = make_llm(target, speculator=spec, **GRAPHS, max_num_seqs=3, mixed_prefill=mixed,
                       max_num_batched_tokens=budget)
        assert llm.engine.scheduler.config.mixed_prefill is mixed
        assert llm.engine.scheduler.config.num_speculative_tokens == (k or 0)  # the reserve's K
        got = _answers(llm, prompts, params)
        spec = llm.engine.stats.spec
        assert k is None or spec.num_accepted_tokens > 0.3 * spec.num_drafted_tokens
        return got, steps

    got, steps = run(False)
    assert got == want
    assert all(uniform for decodes, uniform in steps if decodes)
    assert sum(not decodes for decodes, _ in steps) >= 4  # the first three prompts, then admissions apart
    assert [len(p) for p in prompts[:2]] == [5, 13]  # 18 rows: more than one 16-row prefill step
    got, steps = run(False, budget=16)
    assert got == want
    assert all(uniform for decodes, uniform in steps if decodes)
    assert sizes[0] == (1, 5)  # the second prompt does not join the first as an 11-token chunk
    got, steps = run(True)
    assert got == want
    assert any(decodes and not uniform for decodes, uniform in steps)


def test_prefill_ahead_is_none_with_mixed_prefill_or_a_prompt_still_prefilling():
    s = _sched(True)
    _decoding(s, "a", 3)
    s.add_request(_req("b", 5))
    assert s.schedule_prefill_ahead() is None  # mixed prefill: the next schedule() mixes instead
    s = _sched(False, budget=8, blocks=32)
    _decoding(s, "a", 3)
    b = _req("b", 5)
    s.add_request(b)
    assert _rows(s.schedule_prefill_ahead()) == [("b", 0, 5, True)]
    assert s.schedule_prefill_ahead() is None  # nothing waits any more
    b.num_computed_tokens, b.output_token_ids = 5, [4]  # its prefill committed
    c = _req("c", 20)
    s.add_request(c)
    assert _rows(s.schedule_prefill_ahead()) == [("c", 0, 8, False)]  # a first chunk
    s.add_request(_req("d", 4))
    assert s.schedule_prefill_ahead() is None  # c's next chunk comes first, in schedule()


@pytest.mark.parametrize("k", [None, 1, 3], ids=["plain", "dflash-k1", "dflash-k3"])
def test_async_scheduling_launches_waiting_prompts_prefill_ahead_with_the_same_answers(target, monkeypatch, k):
    """Async scheduling without mixed prefill: when a request waits to start, its prefill step is
    launched before the decode step in flight is read back; the answers and stops are those of
    synchronous scheduling and of plain eager decoding, token for token, greedy and seeded T > 0,
    with most drafts accepted."""
    from blockdraft.engine.scheduler import Scheduler

    prompts, params = _arrivals()
    want = _answers(make_llm(target), prompts, params)
    assert any(reason == "stop" for _, reason in want)  # a stop inside a draft block is covered
    sequences = _plain_sequences(target, prompts, params)
    ahead, schedule_ahead = [], Scheduler.schedule_prefill_ahead

    def recorded(self, completing=()):
        ahead.append(schedule_ahead(self, completing))
        return ahead[-1]

    monkeypatch.setattr(Scheduler, "schedule_prefill_ahead", recorded)

    def run(async_scheduling):
        spec = None if k is None else _oracle_speculator(target, k, sequences)
        llm = make_llm(target, speculator=spec, **GRAPHS, max_num_seqs=3, mixed_prefill=False,
                       async_scheduling=async_scheduling)
        got = _answers(llm, prompts, params)
        spec = llm.engine.stats.spec
        assert k is None or spec.num_accepted_tokens > 0.3 * spec.num_drafted_tokens
        return got

    assert run(False) == want and not ahead
    assert run(True) == want
    assert sum(s is not None for s in ahead) >= 3  # prefill steps really launched ahead
