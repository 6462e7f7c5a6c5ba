"""Async scheduling (the next uniform step launched from this step's device output before it is read
back) emits exactly the tokens of synchronous scheduling: plain and speculative, greedy and seeded,
with stops one step late, requests arriving and aborted mid-chain, and the context limit.

Runs the padded graph code eagerly on CPU (graph_mode="eager", dense sync-free backend). An oracle
drafter (the tokens plain decoding will emit, with one corrupted draft now and then) makes many
drafts accepted, so the device-side position arithmetic sees every accepted count."""

import random

import pytest
import torch

from blockdraft.engine.outputs import ScheduledRequest, SchedulerOutput
from blockdraft.runner.continuation import advance_static_inputs, advanced_rows
from blockdraft.runner.cuda_graphs import StaticInputs
from blockdraft.runner.input_batch import BatchPadding, build_input_batch
from blockdraft.runner.model_runner import ModelRunner
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import EOS_ID, make_llm, random_prompts, tiny_target, word

GRAPHS = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=8)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, logit_scale=8.0)


def _oracle_speculator(target, k: int, sequences: list[list[int]], seed: int = 0):
    """A DFlash speculator whose drafts are the continuation of whichever expected sequence has the
    bonus token at the bonus position (a wrong or corrupted draft only lowers acceptance)."""
    drafter = random_drafter(target.config, num_layers=1, block_size=k + 1, target_layer_ids=(0, 2), seed=1)
    spec = DFlashSpeculator(drafter, target.model, k, None, 4)
    propose_block = spec.propose_block  # `propose` and the graph step's DraftStep both come here

    def oracle(features, positions, slots, block, block_table):
        drafts = propose_block(features, positions, slots, block, block_table)
        bonus_tokens = block.token_ids.view(-1, block.num_block_tokens)[:, 0]
        for r, (tok, pos) in enumerate(zip(bonus_tokens.tolist(), block.seq_lens.tolist())):
            seq = next((s for s in sequences if pos < len(s) and s[pos] == tok), None)
            if seq is None:
                continue
            guess = (seq[pos + 1 : pos + 1 + k] + [1] * k)[:k]
            rng = random.Random(seed + 1000 * pos + tok)  # keyed: async's extra proposals change nothing
            if rng.random() < 0.5:
                guess[rng.randrange(k)] = (guess[0] + 7) % 90 + 1
            drafts[r] = torch.tensor(guess)
        return drafts

    spec.propose_block = oracle
    return spec


def _count_continuations(monkeypatch):
    """Count the continuation and join steps launched (each a step launched before its
    predecessor is read back), and the continuations that left out requests that stopped."""
    counts = {"continued": 0, "joined": 0, "subset": 0}
    continuation, join = ModelRunner.launch_continuation, ModelRunner.launch_join

    def continued(self, prev, so):
        out = continuation(self, prev, so)
        counts["continued"] += out is not None
        counts["subset"] += out is not None and len(so.requests) < len(prev.so.requests)
        return out

    def joined(self, prev, so):
        out = join(self, prev, so)
        counts["joined"] += out is not None
        return out

    monkeypatch.setattr(ModelRunner, "launch_continuation", continued)
    monkeypatch.setattr(ModelRunner, "launch_join", joined)
    return counts


def _params(n):
    stops = [dict(), dict(stop_token_ids=[17]), dict(stop=[word(23)]), dict(ignore_eos=True)]
    return [SamplingParams(max_tokens=[9, 20, 31, 40, 26][i % 5], temperature=0.8 * (i % 2), seed=i, **stops[i % 4])
            for i in range(n)]  # fmt: skip


def _run(llm, prompts, params):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in llm.generate(prompts, params)]


def test_async_plain_decoding_equals_sync(target, monkeypatch):
    prompts, params = random_prompts(5, seed=1), _params(5)
    sync = make_llm(target, **GRAPHS, async_scheduling=False)
    assert sync.engine.runner.graphs.continuation is None  # built only for async scheduling
    want = _run(sync, prompts, params)
    counts = _count_continuations(monkeypatch)
    llm = make_llm(target, **GRAPHS, async_scheduling=True)
    assert llm.engine.runner.graphs.continuation is not None
    assert _run(llm, prompts, params) == want
    assert counts["continued"] > 20 and counts["subset"] >= 3
    # every continuation or join launched and not dropped is counted once, when its step reads it back
    assert 20 < llm.engine.stats.num_async_steps <= counts["continued"] + counts["joined"]
    assert llm.engine.stats.num_async_steps < llm.engine.stats.num_steps


@pytest.mark.parametrize("k", [1, 3])
def test_async_speculative_equals_sync_with_many_accepted_drafts(target, monkeypatch, k):
    prompts, params = random_prompts(5, seed=10 + k), _params(5)
    plain = make_llm(target).generate(prompts, [SamplingParams(max_tokens=60, ignore_eos=True, temperature=p.temperature,
                                                               seed=p.seed) for p in params])
    sequences = [p + o.token_ids for p, o in zip(prompts, plain)]
    sync = make_llm(target, speculator=_oracle_speculator(target, k, sequences), **GRAPHS, async_scheduling=False)
    want = _run(sync, prompts, params)
    assert want == _run(make_llm(target), prompts, params)  # speculative == plain, same params and seeds
    counts = _count_continuations(monkeypatch)
    llm = make_llm(target, speculator=_oracle_speculator(target, k, sequences), **GRAPHS, async_scheduling=True)
    assert _run(llm, prompts, params) == want
    assert counts["continued"] > 5 and counts["subset"] >= 3  # requests stop at different steps
    got, ref = llm.engine.stats.spec, sync.engine.stats.spec
    assert (got.num_steps, got.num_drafted_tokens, got.num_accepted_tokens) == (
        ref.num_steps, ref.num_drafted_tokens, ref.num_accepted_tokens)
    assert got.num_accepted_tokens > 0.3 * got.num_drafted_tokens  # the oracle's drafts are mostly accepted



@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_async_after_a_graphed_single_request_prefill_equals_sync(target, monkeypatch, k):
    """Requests arriving one at a time prefill through the prefill graphs (not continuable), then
    chain continuations from the uniform steps: same answers as synchronous scheduling."""
    from blockdraft.runner.prefill_graphs import PrefillGraphs

    prompts, params = random_prompts(4, seed=30), _params(4)
    sequences = [p + o.token_ids for p, o in zip(prompts, make_llm(target).generate(
        prompts, [SamplingParams(max_tokens=60, ignore_eos=True, temperature=q.temperature, seed=q.seed)
                  for q in params]))]  # fmt: skip

    def build(async_scheduling):
        spec = None if k is None else _oracle_speculator(target, k, sequences)
        return make_llm(target, speculator=spec, **GRAPHS, async_scheduling=async_scheduling)

    sync = build(False)
    want = [_run(sync, [p], [q])[0] for p, q in zip(prompts, params)]
    counts = _count_continuations(monkeypatch)
    prefills, run = [], PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, batch: prefills.append(batch.num_rows) or run(self, batch))
    llm = build(True)
    assert [_run(llm, [p], [q])[0] for p, q in zip(prompts, params)] == want
    assert sorted(prefills) == sorted(len(p) for p in prompts) and counts["continued"] > 5

JOIN = dict(GRAPHS, max_num_seqs=3, mixed_prefill=False)  # prefill apart from decode, as on the GPU


def _serve_window(engine, prompts, params, width: int) -> dict:
    """A server's window: `width` requests at first, the next sent as one finishes -> {request id:
    (token ids, finish reason)}."""
    sent, done = width, {}
    for i in range(width):
        engine.add_request(f"r{i}", prompts[i], params[i])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason)
                if sent < len(prompts):
                    engine.add_request(f"r{sent}", prompts[sent], params[sent])
                    sent += 1
    return done


def _window_params(plain_tokens: list[list[int]]) -> list[SamplingParams]:
    """Per request: max_tokens 1 (stops in its prefill step), a stop id equal to its first token,
    a stop string, EOS, long ones; greedy and seeded T > 0."""
    params = []
    for i, tokens in enumerate(plain_tokens):
        kind = i % 5
        kw = dict(max_tokens=[1, 20, 31, 40, 26][kind], temperature=0.8 * (i % 2), seed=i)
        if kind == 1 and not i % 2:
            kw["stop_token_ids"] = [tokens[0]]  # greedy: its first token is known
        if kind == 2:
            kw["stop"] = [word(23)]
        if kind == 3:
            kw["ignore_eos"] = True
        params.append(SamplingParams(**kw))
    return params


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_newcomers_join_the_running_requests_before_their_prefill_is_read_back(target, monkeypatch, k):
    """Without mixed prefill, the prefill of a newcomer is launched ahead of reading a decode step
    back; the uniform step in which it joins the others is launched before the prefill is read
    back, its tokens copied from the prefill's device output (Scheduler.schedule_join). 12
    requests through 3 sequence slots: same tokens, stops and text as synchronous scheduling and
    as plain decoding, with newcomers that stop in their prefill step (max_tokens 1, a stop id
    equal to their first token) and seeded sampling."""
    prompts = random_prompts(12, seed=50)
    first = [o.token_ids for o in make_llm(target).generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))]
    params = _window_params(first)
    long = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=q.temperature, seed=q.seed) for q in params]
    sampled = make_llm(target).generate(prompts, long)
    sequences = [p + o.token_ids for p, o in zip(prompts, sampled)]

    def build(async_scheduling):
        spec = None if k is None else _oracle_speculator(target, k, sequences)
        return make_llm(target, speculator=spec, **JOIN, async_scheduling=async_scheduling)

    sync = build(False)
    want = _run(sync, prompts, params)
    assert want == _run(make_llm(target), prompts, params)
    assert want[0][2] == "length" and len(want[0][0]) == 1 and want[6][2] == "stop" and len(want[6][0]) == 1
    counts = _count_continuations(monkeypatch)
    llm = build(True)
    assert _run(llm, prompts, params) == want
    assert counts["joined"] >= 6 and counts["continued"] > 5
    got, ref = llm.engine.stats.spec, sync.engine.stats.spec  # the newcomers' first drafts verified as in sync
    assert (got.num_steps, got.num_drafted_tokens, got.num_accepted_tokens) == (
        ref.num_steps, ref.num_drafted_tokens, ref.num_accepted_tokens)


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_a_window_of_requests_prefills_newcomers_behind_a_prefill_in_flight(target, monkeypatch, k):
    """A server's window (the next request sent as one finishes, 3 in flight): a request that
    arrives while the prefill of another is in flight is prefilled right behind it (launched
    before that prefill is read back), and both join the others. Same answers as sync."""
    from blockdraft.engine.scheduler import Scheduler

    prompts = random_prompts(16, seed=52)
    params = [SamplingParams(max_tokens=[3, 9, 5, 14, 7][i % 5], ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(16)]  # fmt: skip
    long = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=q.temperature, seed=q.seed) for q in params]
    sequences = [p + o.token_ids for p, o in zip(prompts, make_llm(target).generate(prompts, long))]

    def window(async_scheduling):
        spec = None if k is None else _oracle_speculator(target, k, sequences)
        engine = make_llm(target, speculator=spec, **JOIN, async_scheduling=async_scheduling).engine
        return _serve_window(engine, prompts, params, 3)

    want = window(False)
    plain = make_llm(target).generate(prompts, params)
    assert want == {f"r{i}": (o.token_ids, o.finish_reason) for i, o in enumerate(plain)}
    behind, original = [], Scheduler.schedule_prefill_ahead

    def counted(self, completing=()):
        out = original(self, completing)
        behind.append(bool(completing) and out is not None)
        return out

    monkeypatch.setattr(Scheduler, "schedule_prefill_ahead", counted)
    counts = _count_continuations(monkeypatch)
    assert window(True) == want and len(want) == 16
    assert counts["joined"] >= 4
    assert sum(behind) >= (2 if k else 0)  # plain requests here never arrive in consecutive steps


def test_no_join_after_a_prefill_whose_requests_ask_for_logprobs(target, monkeypatch):
    """The join's replay would overwrite the prefill's logits before they are read: with
    log-probabilities asked for, no join, and the same tokens and log-probabilities as sync."""
    prompts = random_prompts(6, seed=51)
    # the first three prefill together without log-probabilities (a join follows), the last three with
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2 if i >= 3 else None) for i in range(6)]

    def run(async_scheduling):
        outs = make_llm(target, **JOIN, async_scheduling=async_scheduling).generate(prompts, params)
        return [(o.token_ids, o.logprobs) for o in outs]

    want = run(False)
    after, join = [], ModelRunner.launch_join

    def recorded(self, prev, so):
        out = join(self, prev, so)
        if out is not None:  # whether the step it followed asked for log-probabilities
            after.append(any(sr.sampling_params.logprobs is not None for sr in prev.so.requests))
        return out

    monkeypatch.setattr(ModelRunner, "launch_join", recorded)
    got = run(True)
    assert got == want and any(lp for _, lp in got)
    assert after and not any(after)  # joins happened, none after a step with log-probabilities


def _drive(engine, prompts, params, add_at: int, abort_at: int) -> dict:
    """Add 3 requests, step; add 2 more at step `add_at`, abort req-1 at step `abort_at`."""
    done = {}
    for i in range(3):
        engine.add_request(f"req-{i}", prompts[i], params[i])
    step = 0
    while engine.has_unfinished_requests() or step < add_at:
        step += 1
        if step == add_at:
            for i in (3, 4):
                engine.add_request(f"req-{i}", prompts[i], params[i])
        if step == abort_at:
            engine.abort_request("req-1")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason)
    return done


def test_async_requests_arriving_and_aborted_mid_chain(target, monkeypatch):
    k = 2
    prompts = random_prompts(5, seed=40)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.7 * (i % 2), seed=i) for i in range(5)]
    plain = make_llm(target).generate(prompts, [SamplingParams(max_tokens=40, ignore_eos=True, temperature=p.temperature,
                                                               seed=p.seed) for p in params])
    sequences = [p + o.token_ids for p, o in zip(prompts, plain)]
    want = {f"req-{i}": (o.token_ids[:30], "length") for i, o in enumerate(plain)}
    counts = _count_continuations(monkeypatch)
    llm = make_llm(target, speculator=_oracle_speculator(target, k, sequences), **GRAPHS, async_scheduling=True)
    done = _drive(llm.engine, prompts, params, add_at=4, abort_at=7)
    assert done.pop("req-1")[1] == "abort"
    want.pop("req-1")
    assert done == want
    assert counts["continued"] > 3


@pytest.mark.parametrize("max_num_seqs", [8, 1])
def test_async_stops_at_the_context_limit_like_sync(max_num_seqs, monkeypatch):
    # max_model_len = 48 tokens: the chain must break before the longest outcome passes it; one
    # sequence slot without mixed prefill: each prompt prefills alone and joins (prompts of 44+
    # tokens leave no room for K drafts: no join)
    target = tiny_target("llama", seed=2, logit_scale=8.0, max_position_embeddings=48)
    prompts = random_prompts(3, seed=3, low=10, high=20) + [list(range(1, 45)), list(range(2, 46))]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    plain = make_llm(target).generate(prompts, params)
    sequences = [p + o.token_ids for p, o in zip(prompts, plain)]
    assert all(o.finish_reason == "length" and len(p) + len(o.token_ids) == 48 for p, o in zip(prompts, plain))
    opts = dict(GRAPHS, max_num_seqs=max_num_seqs, mixed_prefill=max_num_seqs > 1)
    sync = make_llm(target, speculator=_oracle_speculator(target, 3, sequences), **opts, async_scheduling=False)
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert want == [o.token_ids for o in plain]
    counts = _count_continuations(monkeypatch)
    llm = make_llm(target, speculator=_oracle_speculator(target, 3, sequences), **opts, async_scheduling=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert counts["joined"] == (3 if max_num_seqs == 1 else 0)
    got, ref = llm.engine.stats.spec, sync.engine.stats.spec  # the same drafts verified and accepted
    assert (got.num_steps, got.num_drafted_tokens, got.num_accepted_tokens) == (
        ref.num_steps, ref.num_drafted_tokens, ref.num_accepted_tokens)


def test_async_a_reused_request_id_does_not_get_the_old_requests_tokens(target):
    """A request id freed at step N and reused at once must not receive the in-flight step N+1's
    tokens of the old request (the engine keeps the Request objects of in-flight steps)."""
    prompts = random_prompts(3, seed=9)
    long = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(async_scheduling):
        engine = make_llm(target, **GRAPHS, async_scheduling=async_scheduling).engine
        engine.add_request("A", prompts[0], long)
        engine.add_request("X", prompts[1], SamplingParams(max_tokens=3, ignore_eos=True))
        done, readded = {}, False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[(out.request_id, readded)] = out.token_ids
                    if out.request_id == "X" and not readded:
                        engine.add_request("X", prompts[2], SamplingParams(max_tokens=5, ignore_eos=True))
                        readded = True
        return done

    assert run(True) == run(False)


def test_async_step_that_raises_leaves_nothing_launched_ahead(target, monkeypatch):
    """An exception while reading a step back drops the step launched ahead of it: the next steps
    recompute from the host state, and the output equals synchronous scheduling."""
    prompts, params = random_prompts(2, seed=8), SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in make_llm(target, **GRAPHS, async_scheduling=False).generate(prompts, params)]
    llm = make_llm(target, **GRAPHS, async_scheduling=True)
    runner, calls = llm.engine.runner, {"n": 0}
    finish = runner.finish

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return finish(step)

    runner.finish = flaky
    for rid, prompt in zip(("a", "b"), prompts):
        llm.engine.add_request(rid, prompt, params)
    done = {}
    while llm.engine.has_unfinished_requests():
        try:
            outs = llm.engine.step()
        except KeyboardInterrupt:
            assert llm.engine._inflight is None
            continue
        done.update({o.request_id: o.token_ids for o in outs if o.finished})
    assert calls["n"] > 6 and [done["a"], done["b"]] == want


def test_async_scheduling_needs_the_step_graphs(target):
    with pytest.raises(ValueError, match=r"async scheduling needs the CUDA graphs.*device cpu.*--no-async-scheduling"
                                         r".*graph_mode='eager' with attention_backend='dense'"):
        make_llm(target, async_scheduling=True, attention_backend="torch")
    with pytest.raises(ValueError) as e:  # the CLI sets neither test knob: no word about them
        make_llm(target, async_scheduling=True)
    assert str(e.value).endswith("LLM(async_scheduling=False)).") and "graph_mode" not in str(e.value)
    with pytest.raises(ValueError, match=r"async_scheduling must be None, True or False, got 'false'"):
        make_llm(target, async_scheduling="false", **GRAPHS)
    assert make_llm(target).engine.async_scheduling is False  # CPU default: off (no graphs captured)


def _random_uniform_step(rng, n: int, q: int, width: int) -> tuple[SchedulerOutput, list[int], list[list[int]]]:
    """A uniform step of n requests (Q rows, Q - 1 drafts each) at random start positions and
    pages -> (the step, its starts, its pages)."""
    starts = [rng.randint(1, 12) for _ in range(n)]
    pages = [rng.sample(range(40), width) for _ in range(n)]
    so = SchedulerOutput([ScheduledRequest(f"r{i}", [rng.randrange(1, 90) for _ in range(q)], starts[i], q - 1, True,
                                           pages[i], SamplingParams()) for i in range(n)])  # fmt: skip
    return so, starts, pages


def _random_packed(rng, bucket: int, q: int) -> torch.Tensor:
    """A step's packed output [bucket, 2Q]: target tokens, accepted counts, next drafts (junk in
    padding requests' rows too)."""
    return torch.tensor([[rng.randrange(1, 90) for _ in range(q)] + [rng.randrange(q)]
                         + [rng.randrange(1, 90) for _ in range(q - 1)] for _ in range(bucket)])  # fmt: skip


def _step_after(packed: torch.Tensor, starts, pages, keep, q: int) -> SchedulerOutput:
    """The step the synchronous scheduler makes after `packed` for the requests at indices `keep`:
    bonus token target[accepted] and the next drafts, at start + accepted + 1."""
    return SchedulerOutput([ScheduledRequest(
        f"r{i}", [int(packed[i, packed[i, q]])] + packed[i, q + 1 :].tolist(), starts[i] + int(packed[i, q]) + 1,
        q - 1, True, pages[i], SamplingParams()) for i in keep])  # fmt: skip


Q, PAGE, WIDTH, BUCKET = 4, 4, 8, 4  # rows per request, tokens per page, pages per request, padded requests
PADDING = BatchPadding(BUCKET, BUCKET * Q, WIDTH)


def _random_case(rng, n: int) -> tuple[SchedulerOutput, list[int], list[list[int]], torch.Tensor]:
    """A random uniform step of `n` requests and a random packed output for it: (so, starts, pages, packed)."""
    so, starts, pages = _random_uniform_step(rng, n, Q, WIDTH)
    return so, starts, pages, _random_packed(rng, BUCKET, Q)


def test_advance_static_inputs_equals_the_host_built_batch():
    """For every accepted count, the static inputs advanced on the device equal the static inputs
    loaded from build_input_batch of the SchedulerOutput the synchronous scheduler would have made
    (padding rows and requests included, whatever the padding requests' packed rows hold)."""
    rng = random.Random(0)
    for trial in range(20):
        n = rng.randint(1, 3)
        so, starts, pages, packed = _random_case(rng, n)
        nxt = _step_after(packed, starts, pages, range(n), Q)
        got, want = (StaticInputs.allocate(BUCKET + 2, Q, WIDTH, "cpu") for _ in range(2))
        got.load(build_input_batch(so, PAGE, "cpu", host_metadata=False, padding=PADDING))
        want.load(build_input_batch(nxt, PAGE, "cpu", host_metadata=False, padding=PADDING))
        advance_static_inputs(got, packed, BUCKET, Q, PAGE)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table", "query_start_loc", "row_req"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (trial, name)
    with pytest.raises(ValueError, match=r"packed output has shape \(4, 7\), expected \(4, 8\)"):
        advance_static_inputs(got, packed[:, :7], BUCKET, Q, PAGE)


def test_advanced_rows_of_the_requests_still_running_equal_the_host_built_batch():
    """When some requests of step N stopped, the rows gathered on the device for the others
    (continuation.advanced_rows) equal build_input_batch of the step the synchronous scheduler
    would have made for them, for every accepted count and subset."""
    rng = random.Random(1)
    for trial in range(30):
        n = rng.randint(2, 4)
        so, starts, pages, packed = _random_case(rng, n)
        inputs = StaticInputs.allocate(BUCKET, Q, WIDTH, "cpu")
        inputs.load(build_input_batch(so, PAGE, "cpu", host_metadata=False, padding=PADDING))
        keep = sorted(rng.sample(range(n), rng.randint(1, n - 1)))
        want = build_input_batch(_step_after(packed, starts, pages, keep, Q), PAGE, "cpu", host_metadata=False)
        ids, pos, slots, seq_lens = advanced_rows(inputs, packed, torch.tensor(keep), Q, want.meta.block_table, PAGE)
        assert torch.equal(ids, want.input_ids) and torch.equal(pos, want.positions), trial
        assert torch.equal(slots, want.slot_mapping) and torch.equal(seq_lens, want.meta.seq_lens), trial


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_admission_batching_keeps_the_answers_and_prefills_newcomers_together(target, monkeypatch, k):
    """A server's window (4 in flight, 20 requests, the next sent as one finishes) with
    admission_batch_ratio 0.5: newcomers wait for a second free slot (or 3 decode steps), so
    fewer prefill steps run, with the answers of plain decoding, sync and async alike (greedy and
    seeded T = 0.8, stop ids met inside a verify block)."""
    from blockdraft.runner.prefill_graphs import PrefillGraphs

    prompts = random_prompts(20, seed=53)
    params = [SamplingParams(max_tokens=[4, 11, 6, 15, 8][i % 5], ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(20)]  # fmt: skip
    long = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=q.temperature, seed=q.seed) for q in params]
    sequences = [p + o.token_ids for p, o in zip(prompts, make_llm(target).generate(prompts, long))]
    for i in range(0, 20, 4):  # greedy ones: a stop id met at their 3rd token, inside a verify block
        params[i] = SamplingParams(max_tokens=15, ignore_eos=True, stop_token_ids=[sequences[i][len(prompts[i]) + 2]])
    prefills, run = [], PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, batch: prefills.append(batch.num_rows) or run(self, batch))

    def window(async_scheduling, ratio):
        spec = None if k is None else _oracle_speculator(target, k, sequences)
        engine = make_llm(target, speculator=spec, **dict(JOIN, max_num_seqs=4), async_scheduling=async_scheduling,
                          admission_batch_ratio=ratio, admission_max_wait_steps=3).engine
        prefills.clear()
        return _serve_window(engine, prompts, params, 4), len(prefills)

    plain = make_llm(target).generate(prompts, params)
    want = {f"r{i}": (o.token_ids, o.finish_reason) for i, o in enumerate(plain)}
    assert sum(reason == "stop" for _, reason in want.values()) >= 5
    results = {(a, ratio): window(a, ratio) for a in (False, True) for ratio in (0.0, 0.5)}
    assert all(done == want for done, _ in results.values())
    for a in (False, True):
        assert results[(a, 0.5)][1] < results[(a, 0.0)][1], results


def test_admission_batching_defaults_on_with_a_drafter_only(target):
    spec = _oracle_speculator(target, 3, [])
    assert make_llm(target, **JOIN).engine.scheduler.config.admission_batch_ratio == 0.0
    config = make_llm(target, speculator=spec, **JOIN).engine.scheduler.config
    assert (config.admission_batch_ratio, config.admission_max_wait_steps) == (0.25, 8)
    config = make_llm(target, speculator=spec, **JOIN, admission_batch_ratio=0.0,
                      admission_max_wait_steps=3).engine.scheduler.config
    assert (config.admission_batch_ratio, config.admission_max_wait_steps) == (0.0, 3)


@pytest.mark.parametrize("k", [None, 3])
def test_adjusted_logits_under_async_scheduling_equal_sync(target, monkeypatch, k):
    """Penalties / logit bias keep a request out of continuation and join steps (its entries are
    laid out from committed output); min_tokens only until its output is that long, after which
    the chain continues. Tokens equal synchronous scheduling's either way."""
    prompts = random_prompts(5, seed=3)
    adjust = [dict(min_tokens=6, stop_token_ids=[17]), dict(repetition_penalty=1.3), dict(logit_bias={5: 2.0}),
              dict(min_tokens=4), dict()]  # fmt: skip
    params = [SamplingParams(max_tokens=30, temperature=0.8 * (i % 2), seed=i, **adjust[i]) for i in range(5)]
    sequences = [p + o for p, o in zip(prompts, [x[0] for x in _run(make_llm(target), prompts, params)])]
    spec = (lambda: _oracle_speculator(target, k, sequences)) if k else (lambda: None)
    want = _run(make_llm(target, speculator=spec(), **GRAPHS, async_scheduling=False), prompts, params)
    for only in ([0, 3], [0, 1, 2, 3, 4]):  # min_tokens alone: the chain continues once past it
        counts = _count_continuations(monkeypatch)
        llm = make_llm(target, speculator=spec(), **GRAPHS, async_scheduling=True)
        got = _run(llm, [prompts[i] for i in only], [params[i] for i in only])
        assert got == [want[i] for i in only]
        if only == [0, 3]:
            assert counts["continued"] > 0
