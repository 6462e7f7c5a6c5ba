import pytest

from blockdraft.config import SchedulerConfig
from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.request import Request
from blockdraft.engine.scheduler import Scheduler
from blockdraft.sampling_params import SamplingParams


def _sched(budget=8, seqs=4, blocks=8, bs=4):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs), KVCacheManager(blocks, bs))


def _req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams())


def test_chunked_prefill_respects_token_budget_and_samples_only_at_the_end():
    s = _sched(budget=8)
    r = _req("a", 20)
    s.add_request(r)
    chunks = []
    while True:
        out = s.schedule()
        sr = out.requests[0]
        chunks.append((sr.start_position, len(sr.token_ids), sr.sample))
        r.num_computed_tokens += len(sr.token_ids)
        if sr.sample:
            break
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_running_requests_come_first_and_drafts_are_scheduled_after_the_anchor():
    s = _sched(budget=16)
    a = _req("a", 3)
    s.add_request(a)
    s.schedule()
    a.num_computed_tokens = 3
    a.output_token_ids = [7]
    a.spec_token_ids = [8, 9, 10]
    s.add_request(_req("b", 5))
    out = s.schedule()
    first = out.requests[0]
    assert first.request_id == "a" and first.token_ids == [7, 8, 9, 10]
    assert first.num_spec_tokens == 3 and first.sample and first.start_position == 3
    assert out.requests[1].request_id == "b"


def test_drafts_that_do_not_fit_the_budget_are_dropped():
    s = _sched(budget=2)
    a = _req("a", 2)
    s.add_request(a)
    s.schedule()
    a.num_computed_tokens = 2
    a.output_token_ids = [5]
    a.spec_token_ids = [6, 7, 8]
    sr = s.schedule().requests[0]
    assert sr.token_ids == [5, 6] and sr.num_spec_tokens == 1 and sr.sample


def test_pool_exhaustion_preempts_newest_and_requeues_it_first():
    s = _sched(budget=64, blocks=3, bs=4)
    a, b = _req("a", 4), _req("b", 4)
    s.add_request(a)
    s.add_request(b)
    s.schedule()
    for r in (a, b):
        r.num_computed_tokens = 4
        r.output_token_ids = [9]
    # a needs a second page (5 tokens) and b too; only one page is left: b is preempted
    out = s.schedule()
    assert out.preempted_request_ids == ["b"]
    assert [r.request_id for r in out.requests] == ["a"]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and s.waiting[0] is b
    assert b.output_token_ids == [9]  # produced tokens are kept, then recomputed


def test_a_request_preempted_by_an_earlier_one_is_skipped_this_step():
    s = _sched(budget=64, blocks=4, bs=4)
    a, b, c = _req("a", 4), _req("b", 4), _req("c", 4)
    for r in (a, b, c):
        s.add_request(r)
    s.schedule()
    for r in (a, b, c):
        r.num_computed_tokens = 4
        r.output_token_ids = [9]
    # a takes the last free page; b needs one too and preempts c, the newest; c is then skipped
    out = s.schedule()
    assert out.preempted_request_ids == ["c"]
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert s.running == [a, b] and list(s.waiting) == [c]
    s.finish(c)  # a waiting request leaves the waiting queue
    assert not s.waiting and c.is_finished and s.kv.num_free_blocks == 0


def test_request_larger_than_pool_is_refused_with_a_clear_error():
    s = _sched(blocks=2, bs=4)
    with pytest.raises(ValueError, match="needs 3 KV pages"):
        s.add_request(_req("a", 9))
