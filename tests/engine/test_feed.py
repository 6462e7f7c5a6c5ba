"""engine.feed.feed_requests: a window of requests in flight, a wall-clock deadline, clean aborts."""

import pytest

import blockdraft.engine.feed as feed
from blockdraft.engine.feed import feed_requests
from blockdraft.sampling_params import SamplingParams
from blockdraft.training.generate import generate_with_engine
from tests.conftest import make_llm, random_prompts


@pytest.fixture(scope="module")
def llm(llama_target):
    return make_llm(llama_target)


def _tokens(outs):
    return [None if o is None else list(o.token_ids) for o in outs]


def test_the_window_bounds_the_requests_in_flight_and_answers_equal_generate(llm, monkeypatch):
    prompts = random_prompts(6, seed=1)
    params = [SamplingParams(max_tokens=[3, 9, 5, 7, 2, 6][i], ignore_eos=True) for i in range(6)]
    want = [list(o.token_ids) for o in llm.generate(prompts, params)]
    engine, seen, step = llm.engine, [], llm.engine.step
    monkeypatch.setattr(engine, "step", lambda stream=True: seen.append(len(engine._requests)) or step(stream))
    finished = []
    outs = feed_requests(engine, prompts, params, 2, on_finished=finished.append)
    assert _tokens(outs) == want and max(seen) == 2 and len(finished) == 6
    assert not engine.has_unfinished_requests()


def test_the_deadline_aborts_the_unfinished_requests(llm, monkeypatch):
    prompts = random_prompts(5, seed=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [list(o.token_ids) for o in llm.generate(prompts, params)]
    clock = iter(range(1000))  # one tick per check: the deadline passes after 8 of them
    monkeypatch.setattr(feed.time, "time", lambda: next(clock))
    got = _tokens(feed_requests(llm.engine, prompts, params, 2, deadline=7.5))
    assert None in got and any(g is not None for g in got)
    assert all(g is None or g == w for g, w in zip(got, want))  # the answered ones are complete
    assert not llm.engine.has_unfinished_requests()  # aborted: their pages are free
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks
    assert _tokens(feed_requests(llm.engine, prompts, params, 2, deadline=-1.0)) == [None] * 5


def test_bad_arguments_queue_nothing(llm):
    prompts = random_prompts(3, seed=3)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="in_flight must be >= 1, got 0"):
        feed_requests(llm.engine, prompts, params, 0)
    with pytest.raises(ValueError, match="got 2 sampling params for 3 prompts"):
        feed_requests(llm.engine, prompts, [params] * 2, 2)
    with pytest.raises(ValueError, match="prompt is empty"):
        feed_requests(llm.engine, prompts + [[]], params, 2)
    assert not llm.engine.has_unfinished_requests()


def test_training_answers_with_a_deadline_come_from_the_same_loop(llm, monkeypatch):
    prompts = random_prompts(4, seed=4)
    full = generate_with_engine(llm, prompts, 5, [False] * 4)
    assert generate_with_engine(llm, prompts, 5, [False] * 4, deadline=float("inf")) == full
    monkeypatch.setattr(feed.time, "time", lambda: 10.0)
    assert generate_with_engine(llm, prompts, 5, [False] * 4, deadline=5.0) == [None] * 4


def test_a_deadline_on_an_async_engine_leaves_nothing_in_flight(tiny_qwen_async):
    llm, prompts = tiny_qwen_async
    clock = iter(range(1000))
    feed_time = feed.time.time
    try:
        feed.time.time = lambda: next(clock)
        got = _tokens(feed_requests(llm.engine, prompts, SamplingParams(max_tokens=30, ignore_eos=True), 2,
                                    deadline=6.5))
    finally:
        feed.time.time = feed_time
    assert None in got
    engine = llm.engine
    assert engine._inflight is None and not engine._finished_unreported  # read back, outputs popped
    assert not engine.has_unfinished_requests()


@pytest.fixture
def tiny_qwen_async():
    from tests.conftest import tiny_target

    target = tiny_target("qwen3", seed=5, logit_scale=8.0)
    llm = make_llm(target, attention_backend="dense", graph_mode="eager", async_scheduling=True, max_num_seqs=2)
    return llm, random_prompts(4, seed=8)
