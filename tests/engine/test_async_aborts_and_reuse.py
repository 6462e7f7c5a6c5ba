"""Async scheduling against aborts and reused request ids while a prefill launched ahead, a join or
a continuation is in flight (the padded graph code run eagerly on CPU, no mixed prefill, as on
the GPU): every request's tokens, finish and stop reasons equal plain decoding; an aborted
request's tokens are a prefix of them."""

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts, tiny_target
from tests.engine.test_async_scheduling import JOIN, _count_continuations, _oracle_speculator


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, logit_scale=8.0)  # as test_async_scheduling's


def _summary(out):
    return out.token_ids, out.finish_reason, out.stop_reason


def _build(target, k, prompts, params, **kw):
    """An async engine (oracle drafter with K = k, or plain) over the expected continuations."""
    spec = None
    if k is not None:
        long = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=q.temperature, seed=q.seed) for q in params]
        sequences = [p + o.token_ids for p, o in zip(prompts, make_llm(target).generate(prompts, long))]
        spec = _oracle_speculator(target, k, sequences)
    return make_llm(target, speculator=spec, **JOIN, async_scheduling=True, **kw).engine


def _in_flight(engine) -> tuple[str | None, list[str]]:
    """The kind of the step launched ahead ("prefill", "join", "continuation", "uniform") and its ids."""
    if engine._inflight is None:
        return None, []
    so = engine._inflight[1].so
    if not engine._inflight[1].graphed:
        kind = "prefill"
    elif any(sr.start_position == -1 for sr in so.requests):
        kind = "continuation"
    else:
        kind = "join" if any(sr.token_ids[0] == -1 for sr in so.requests) else "uniform"
    return kind, [sr.request_id for sr in so.requests]


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
@pytest.mark.parametrize("kind", ["prefill", "join", "continuation"])
def test_abort_while_a_step_of_that_kind_is_in_flight_then_reuse_the_id(target, k, kind):
    """Requests arrive every other step; whenever the step in flight is of `kind`, its newest
    request is aborted (up to 3 times) and its id re-added with another prompt once the abort is
    reported."""
    prompts = random_prompts(10, seed=77)
    params = [SamplingParams(max_tokens=[12, 1, 20, 7, 15][i % 5], ignore_eos=True, temperature=0.7 * (i % 2), seed=i)
              for i in range(10)]  # fmt: skip
    want = [_summary(o) for o in make_llm(target).generate(prompts, params)]
    engine = _build(target, k, prompts, params)
    done: dict[str, list] = {}
    aborted, readd = [], []
    for step in range(1, 500):
        if step < 17 and step % 2:
            i = step // 2
            engine.add_request(f"r{i}", prompts[i], params[i])
        for rid in [r for r in readd if r in done]:
            readd.remove(rid)
            engine.add_request(rid, prompts[9], params[9])
        now, ids = _in_flight(engine)
        victim = ids[-1] if now == kind and ids else None
        if victim and len(aborted) < 3 and victim not in aborted and victim not in done:
            engine.abort_request(victim)
            aborted.append(victim)
            readd.append(victim)
        for out in engine.step():
            if out.finished:
                done.setdefault(out.request_id, []).append(_summary(out))
        if step > 17 and not engine.has_unfinished_requests() and not readd:
            break
    assert aborted
    for i in range(8):
        rid = f"r{i}"
        if rid in aborted:
            (tokens, reason, _), again = done[rid]
            assert reason == "abort" and tokens == want[i][0][: len(tokens)] and again == want[9], rid
        else:
            assert done[rid] == [want[i]], rid


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_an_id_reused_at_once_while_the_step_in_flight_still_carries_the_old_request(target, k, prefix_caching,
                                                                                     monkeypatch):
    """When X finishes, X is re-added at once with X's prompt + answer + one token (a prefix hit
    with caching) while the step launched ahead still carries the old X: both answers as plain."""
    counts = _count_continuations(monkeypatch)
    prompts = random_prompts(6, seed=91)
    first = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.7 * (i % 2), seed=i)
             for i, m in enumerate([6, 1, 9, 3, 14, 2])]  # fmt: skip
    want_first = [_summary(o) for o in make_llm(target).generate(prompts, first)]
    second_prompts = [p + w[0] + [7] for p, w in zip(prompts, want_first)]
    second = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.7 * (i % 2), seed=i + 50)
              for i, m in enumerate([5, 8, 1, 4, 3, 7])]  # fmt: skip
    want_second = [_summary(o) for o in make_llm(target).generate(second_prompts, second)]
    engine = _build(target, k, prompts + second_prompts, first + second, enable_prefix_caching=prefix_caching)
    for i in range(6):
        engine.add_request(f"r{i}", prompts[i], first[i])
    done, in_flight_at_reuse = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                i = int(out.request_id[1:])
                generation = 1 if (i, 0) in done else 0
                done[(i, generation)] = _summary(out)
                if generation == 0:
                    in_flight_at_reuse += out.request_id in _in_flight(engine)[1]
                    engine.add_request(out.request_id, second_prompts[i], second[i])
    assert in_flight_at_reuse >= 1 and counts["joined"] >= 1
    assert [done[(i, 0)] for i in range(6)] == want_first
    assert [done[(i, 1)] for i in range(6)] == want_second


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_reset_prefix_cache_right_after_aborting_the_requests_of_a_step_in_flight(target, k):
    """What an interrupted LLM.generate leaves (its requests aborted, their next step launched
    ahead) does not block reset_prefix_cache, and the next request gives plain decoding's tokens."""
    prompts = random_prompts(3, seed=78)
    params = [SamplingParams(max_tokens=20, ignore_eos=True) for _ in prompts]
    want = [_summary(o) for o in make_llm(target).generate(prompts, params)]
    engine = _build(target, k, prompts, params, enable_prefix_caching=True)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    for _ in range(50):
        engine.step()
        if engine._inflight is not None and _in_flight(engine)[0] != "prefill":
            break
    assert engine._inflight is not None, "no step was launched ahead"
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    assert engine.reset_prefix_cache()
    assert engine._inflight is None
    engine.add_request("again", prompts[0], params[0])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished and o.request_id == "again"]
    assert [_summary(o) for o in outs] == want[:1]
