import dataclasses

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
    assert out.preempted_request_ids == ["b"] and s.num_preemptions == 1
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


def _decoding(s, rid, prompt_len, drafts):
    """Admit a request and commit its prompt and first token, with `drafts` drafts (mixed_prefill on)."""
    r = _req(rid, prompt_len)
    s.add_request(r)
    s.schedule()
    r.num_computed_tokens, r.output_token_ids, r.spec_token_ids = prompt_len, [7], list(drafts)
    return r


def test_continuation_leaves_out_stopped_requests_but_not_one_whose_id_a_newer_request_took():
    s = _sched(budget=64, seqs=2, blocks=32)
    a, x = _decoding(s, "a", 3, [8, 9]), _decoding(s, "x", 4, [8, 9])
    step = s.schedule()
    assert [sr.request_id for sr in step.requests] == ["a", "x"]
    s.finish(x)  # x stopped while `step` is in flight: the continuation carries a alone
    nxt = s.schedule_continuation(step, [a, x], max_model_len=64)
    assert [(sr.request_id, sr.token_ids, sr.start_position) for sr in nxt.requests] == [("a", [-1, -1, -1], -1)]
    # a newer request took x's id and place: its rows are not x's continuation
    x2 = _decoding(s, "x", 5, [8, 9])
    assert [r.request_id for r in s.running] == ["a", "x"] and s.running[1] is x2
    assert s.schedule_continuation(step, [a, x], max_model_len=64) is None


def test_join_places_the_in_flight_requests_rows_after_their_known_tokens():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, mixed_prefill=False)
    s = Scheduler(config, KVCacheManager(32, 4))
    a = _decoding(s, "a", 3, [8, 9])
    b = _req("b", 6)
    s.add_request(b)
    prefill = s.schedule_prefill_ahead()  # b's prompt, launched while a's step is in flight
    assert [sr.request_id for sr in prefill.requests] == ["b"] and prefill.requests[0].sample
    join = s.schedule_join(prefill, [b], num_spec_tokens=2, max_model_len=64)
    assert [(sr.request_id, sr.token_ids, sr.start_position, sr.num_spec_tokens) for sr in join.requests] == [
        ("a", [7, 8, 9], 3, 2), ("b", [-1, -1, -1], 6, 2)]
    assert len(b.block_ids) == 3  # 6 + 3 rows in pages of 4
    # refused: drafts would pass the context; `so` verifies drafts; a waiting request could be admitted
    assert s.schedule_join(prefill, [b], num_spec_tokens=2, max_model_len=9) is None
    assert s.schedule_join(join, [a, b], num_spec_tokens=2, max_model_len=64) is None
    s.finish(a)
    s.add_request(_req("c", 2))
    assert s.schedule_join(prefill, [b], num_spec_tokens=2, max_model_len=64) is None


def _batched(ratio, wait, running=4):
    """A scheduler without mixed prefill whose `running` requests r0.. decode (admitted before
    admission batching is switched on), then with admission_batch_ratio / _max_wait_steps set."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, mixed_prefill=False),
                  KVCacheManager(64, 4))
    reqs = [_decoding(s, f"r{i}", 3, [8, 9]) for i in range(running)]
    s.config = dataclasses.replace(s.config, admission_batch_ratio=ratio, admission_max_wait_steps=wait)
    return s, reqs


def test_admission_batching_defers_until_enough_slots_or_the_wait_is_used_up():
    """ratio 0.5 at 3 running: a lone waiting request is held back (decode steps go on) until 2
    fit the free slots, or for at most `wait` decode steps; nothing running admits at once."""
    s, reqs = _batched(0.5, wait=2)
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2", "r3"]
    s.finish(reqs[0])
    s.add_request(_req("new1", 5))
    for _ in range(2):  # 1 admissible < ceil(0.5 x 3) = 2: decode steps, counted
        step = s.schedule()
        assert [sr.request_id for sr in step.requests] == ["r1", "r2", "r3"]
    step = s.schedule()  # the wait is used up: the prefill step of new1
    assert [sr.request_id for sr in step.requests] == ["new1"]
    assert s._admission_wait == 0
    # two free slots, two waiting: admitted together at once
    s2, reqs = _batched(0.5, wait=100)
    s2.finish(reqs[0])
    s2.add_request(_req("a", 5))
    assert [sr.request_id for sr in s2.schedule().requests] == ["r1", "r2", "r3"]
    s2.finish(reqs[1])
    s2.add_request(_req("b", 5))
    assert [sr.request_id for sr in s2.schedule().requests] == ["a", "b"]
    # nothing running: the first request is admitted at once whatever the ratio
    s3, _ = _batched(1.0, wait=100, running=0)
    s3.add_request(_req("x", 5))
    assert [sr.request_id for sr in s3.schedule().requests] == ["x"]


def test_admission_batching_off_or_with_mixed_prefill_admits_at_once():
    for config in (SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, mixed_prefill=False),
                   SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, admission_batch_ratio=1.0)):
        s = Scheduler(config, KVCacheManager(64, 4))
        reqs = [_decoding(s, f"r{i}", 3, []) for i in range(4)]
        s.finish(reqs[0])
        s.add_request(_req("new", 5))
        assert "new" in [sr.request_id for sr in s.schedule().requests]


def test_async_paths_respect_the_admission_gate():
    """While admission is deferred, a decode step in flight continues (schedule_continuation),
    no prefill is launched ahead and a join may go on; once open, the continuation yields."""
    s, reqs = _batched(0.5, wait=1)
    step = s.schedule()
    s.finish(reqs[0])
    s.add_request(_req("new", 5))
    assert s.schedule_prefill_ahead() is None
    nxt = s.schedule_continuation(step, reqs, max_model_len=64)
    assert [sr.request_id for sr in nxt.requests] == ["r1", "r2", "r3"]
    assert s._admission_wait == 0  # counted by the engine once it launches the step
    s.count_decode_step()
    assert s.schedule_continuation(nxt, reqs[1:], max_model_len=64) is None  # waited 1 step: admit now
    ahead = s.schedule_prefill_ahead()
    assert [sr.request_id for sr in ahead.requests] == ["new"] and s._admission_wait == 0


@pytest.mark.parametrize("field, value", [("admission_batch_ratio", -0.1), ("admission_batch_ratio", 1.5),
                                          ("admission_batch_ratio", True), ("admission_batch_ratio", "0.5"),
                                          ("admission_max_wait_steps", -1), ("admission_max_wait_steps", 2.0)])
def test_bad_admission_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SchedulerConfig(**{field: value})
    assert info.value.param == field


def test_admission_batching_never_waits_for_more_than_one_prefill_step_takes():
    """ratio 1.0 at 3 running asks for 3 admissible, but with max_prefill_seqs 2 two suffice."""
    s, reqs = _batched(1.0, wait=100, running=3)
    s.config = dataclasses.replace(s.config, max_num_seqs=5)
    s.add_request(_req("a", 5))
    assert [sr.request_id for sr in s.schedule().requests] == ["r0", "r1", "r2"]  # 1 admissible
    s.add_request(_req("b", 5))
    assert [sr.request_id for sr in s.schedule().requests] == ["r0", "r1", "r2"]  # 2 < 3, no cap
    s.config = dataclasses.replace(s.config, max_prefill_seqs=2)
    assert [sr.request_id for sr in s.schedule().requests] == ["a", "b"]


def _gated(seqs, blocks, running, ratio, wait, **cfg):
    """`running` decoding requests r0.. (admitted with mixed prefill), then admission batching on."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=seqs, mixed_prefill=True),
                  KVCacheManager(blocks, 4))
    reqs = [_decoding(s, f"r{i}", 3, [8, 9]) for i in range(running)]
    s.config = dataclasses.replace(s.config, mixed_prefill=False, admission_batch_ratio=ratio,
                                   admission_max_wait_steps=wait, **cfg)
    return s, reqs


def _ids(so):
    """The request ids of a scheduled step."""
    return [sr.request_id for sr in so.requests]


def test_admission_wait_bound_holds_per_request_when_a_prefill_step_is_full():
    """max_prefill_seqs=1 (the prefill graphs' limit): once the wait expires, the requests a
    full prefill step left waiting are admitted in the next steps, not after another wait."""
    s, _ = _gated(seqs=8, blocks=64, running=4, ratio=1.0, wait=2, max_prefill_seqs=1)
    for name in ("a", "b", "c"):
        s.add_request(_req(name, 5))
    decode_steps_before_b = 0
    for _ in range(20):
        so = s.schedule()
        if "b" in _ids(so):
            break
        if all(sr.sample and sr.num_spec_tokens for sr in so.requests):  # a decode/verify step
            decode_steps_before_b += 1
        for sr in so.requests:  # commit prefills
            r = next(x for x in s.running if x.request_id == sr.request_id)
            if r.request_id in "abc":
                r.num_computed_tokens, r.output_token_ids, r.spec_token_ids = 5, [7], [8, 9]
    # b has been waiting since step 0; documented bound: admitted after <= 2 decode steps
    assert decode_steps_before_b <= 2, decode_steps_before_b


def test_a_preempted_request_is_readmitted_at_once():
    """A request preempted for pages is a readmission: once pages and a slot are free it is
    readmitted at once, with admission batching as without it."""
    for ratio, expect_now in ((0.0, True), (0.5, True)):
        s, reqs = _gated(seqs=6, blocks=11, running=6, ratio=ratio, wait=8)
        so = s.schedule()  # decode step: r5 cannot get its 2nd page -> preempted
        assert so.preempted_request_ids == ["r5"], so.preempted_request_ids
        s.finish(reqs[0])  # pages and a slot free up
        nxt = s.schedule()
        assert ("r5" in _ids(nxt)) == expect_now, (ratio, _ids(nxt))


def test_the_admission_wait_starts_over_after_the_queue_empties():
    s, _ = _gated(seqs=8, blocks=64, running=4, ratio=1.0, wait=8)
    a = _req("a", 5)
    s.add_request(a)
    for _ in range(7):
        assert _ids(s.schedule()) == ["r0", "r1", "r2", "r3"]
    s.finish(a)  # client disconnects while waiting
    for _ in range(30):  # idle period: nothing waiting
        s.schedule()
    s.add_request(_req("b", 5))
    waited = 0
    while "b" not in _ids(s.schedule()):
        waited += 1
    # a fresh arrival should be held for admission_max_wait_steps = 8 decode steps like `a` was
    assert waited == 8, f"b waited {waited} decode steps (stale counter from aborted a)"


def test_only_launched_decode_steps_count_toward_the_admission_wait():
    """LLMEngine._launch_next: a continuation that schedule_continuation built but the runner did
    not launch is not counted; the engine's next schedule() counts the step that runs instead."""
    s, reqs = _gated(seqs=8, blocks=64, running=4, ratio=1.0, wait=8)
    s.add_request(_req("a", 5))
    step = s.schedule()
    assert s._admission_wait == 1
    assert s.schedule_continuation(step, reqs, max_model_len=64) is not None  # launch_continuation -> None
    s.schedule()  # the engine's fallback: the one decode step that actually runs next
    assert s._admission_wait == 2, s._admission_wait
