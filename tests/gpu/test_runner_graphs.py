"""CUDA-graph steps on the GPU: replay == eager token for token (fp32, bf16), speculative ==
plain greedy, graphs really replayed, padded buckets included. `python -m pytest -q tests/gpu`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.gpu.runner_util import cuda_llm, cuda_tiny_target, graph_runs  # noqa: E402

pytestmark = [pytest.mark.gpu]
DTYPES = [torch.float32, torch.bfloat16]


def _params(n: int, max_tokens: int = 40, sampled: bool = True) -> list[SamplingParams]:
    """Greedy and (when `sampled`) seeded T > 0 requests, alternating."""
    return [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if sampled and i % 2 else 0.0, seed=i)
        for i in range(n)
    ]


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [None, 3, 15], ids=["plain", "k3", "k15"])
def test_graph_replay_equals_the_same_padded_step_run_eagerly(dtype, k):
    target = cuda_tiny_target(dtype)
    prompts, params = random_prompts(11, seed=1), _params(11)
    want = _tokens(cuda_llm(target, k, graph_mode="eager"), prompts, params)
    graphed = cuda_llm(target, k)
    graphs = graphed.engine.runner.graphs
    captured = [*graphs.target.graphs.values(), *graphs.tail.graphs.values(), *graphs.continuation.graphs.values()]
    assert all(g.graph is not None for g in captured)
    with graph_runs() as (target_runs, draft_runs):
        assert _tokens(graphed, prompts, params) == want
    assert any(real < padded for real, padded in target_runs), "no padded bucket was replayed"
    assert (k is None) == (not draft_runs)


@pytest.mark.parametrize("k", [None, 4])
def test_graphs_equal_enforce_eager_fp32(k):
    target = cuda_tiny_target(torch.float32, arch="llama", seed=1)
    prompts, params = random_prompts(6, seed=2), _params(6, 48)
    eager = cuda_llm(target, k, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = _tokens(eager, prompts, params)
    with graph_runs() as (target_runs, _):
        assert _tokens(cuda_llm(target, k), prompts, params) == want
    assert target_runs


@pytest.mark.parametrize("k", [1, 7, 15])
def test_speculative_equals_plain_greedy_fp32(k):
    target = cuda_tiny_target(torch.float32, seed=2)
    prompts = random_prompts(9, seed=3)
    params = [SamplingParams(max_tokens=[1, k, k + 1, 64][i % 4], ignore_eos=True) for i in range(9)]
    plain = _tokens(cuda_llm(target), prompts, params)
    llm = cuda_llm(target, k)
    with graph_runs() as (_, draft_runs):
        assert _tokens(llm, prompts, params) == plain
    assert draft_runs and llm.engine.stats.spec.num_drafted_tokens > 0


@pytest.mark.parametrize("k", [None, 7], ids=["plain", "k7"])
def test_penalised_requests_on_graphs_equal_enforce_eager_and_plain_fp32(k):
    """Penalties (sparse entries staged with the batch, the sampler between the target and tail
    graphs even for greedy rows; no async continuation for those requests) on graphed steps give
    the eager engine's tokens, and the speculative ones plain decoding's."""
    target = cuda_tiny_target(torch.float32, seed=4)
    prompts = random_prompts(7, seed=8)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 * (i % 2), seed=i,
                             repetition_penalty=1.4, presence_penalty=0.5 * (i % 3 != 2)) for i in range(7)]  # fmt: skip
    want = _tokens(cuda_llm(target, None, enforce_eager=True), prompts, params)
    with graph_runs() as (target_runs, _):
        assert _tokens(cuda_llm(target, k), prompts, params) == want
    assert target_runs


@pytest.mark.parametrize("k", [None, 7], ids=["plain", "k7"])
def test_min_p_requests_on_graphs_equal_enforce_eager_and_plain_fp32(k):
    """min_p rows (alone, with top-k / top-p; a greedy row with min_p; rows without it) on graphed
    steps, compiled sampler and async continuations included, give the eager engine's tokens, and the
    speculative ones plain decoding's."""
    target = cuda_tiny_target(torch.float32, seed=4)
    prompts = random_prompts(7, seed=9)
    kinds = [dict(temperature=1.0, min_p=0.3), dict(temperature=1.3, min_p=0.1, top_k=20), dict(temperature=0.0, min_p=0.5),
             dict(temperature=0.9, min_p=0.2, top_p=0.8), dict(temperature=1.0)]  # fmt: skip
    params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=i, **kinds[i % len(kinds)]) for i in range(7)]
    want = _tokens(cuda_llm(target, None, enforce_eager=True), prompts, params)
    with graph_runs() as (target_runs, _):
        assert _tokens(cuda_llm(target, k), prompts, params) == want
    assert target_runs
    bare = [SamplingParams(max_tokens=40, ignore_eos=True, seed=p.seed, temperature=p.temperature, top_k=p.top_k,
                           top_p=p.top_p) for p in params]  # fmt: skip
    assert _tokens(cuda_llm(target, None, enforce_eager=True), prompts, bare) != want  # min_p filtered something


@pytest.mark.parametrize("k", [None, 7], ids=["plain", "k7"])
def test_constrained_requests_on_graphs_equal_enforce_eager_and_plain_fp32(k):
    """Structured outputs (token bitmasks computed once the target graph is enqueued, copied to the
    GPU and applied between the target and tail graphs; no async continuation for those requests)
    on graphed steps give the eager engine's
    tokens, and the speculative ones plain decoding's. The device needs the llguidance wheel."""
    pytest.importorskip("llguidance")
    from tests.conftest import make_ascii_tokenizer
    from tests.spec.test_lossless_structured import CONSTRAINTS, _params as constrained_params

    target = dataclasses.replace(cuda_tiny_target(torch.float32, seed=4), tokenizer=make_ascii_tokenizer())
    prompts = random_prompts(len(CONSTRAINTS), seed=10)
    for temperature in (0.0, 0.9):
        params = constrained_params(temperature)
        want = _tokens(cuda_llm(target, None, enforce_eager=True), prompts, params)
        with graph_runs() as (target_runs, _):
            assert _tokens(cuda_llm(target, k), prompts, params) == want
        assert target_runs


@pytest.mark.parametrize("k", [None, 7], ids=["plain", "k7"])
def test_masked_requests_on_graphs_equal_enforce_eager_fp32(k):
    """allowed_token_ids / bad_words (masks staged with the batch, applied between the target and
    tail graphs) on graphed steps with async scheduling give the eager engine's tokens: bad words
    of several tokens never continue unread; static masks do (async steps run), their mask reused
    by the continuation graphs."""
    from tests.spec.test_lossless_token_masks import ALLOWED, _free, _params as masked_params
    from tests.conftest import word

    target = cuda_tiny_target(torch.float32, seed=4)
    prompts = random_prompts(10, seed=10)
    static = [SamplingParams(max_tokens=40, ignore_eos=True, allowed_token_ids=ALLOWED, bad_words=[word(5)],
                             temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    for temperature in (0.0, 0.9):
        eager = cuda_llm(target, None, enforce_eager=True)  # its answers before another engine is built
        params = masked_params(_free(eager, prompts, temperature), temperature, penalties=temperature == 0.0)
        want, want_static = _tokens(eager, prompts, params), _tokens(eager, prompts[:4], static)
        llm = cuda_llm(target, k, async_scheduling=True)
        with graph_runs() as (target_runs, _):
            assert _tokens(llm, prompts, params) == want
        assert target_runs
        before = llm.engine.stats.num_async_steps
        assert _tokens(llm, prompts[:4], static) == want_static
        assert llm.engine.stats.num_async_steps > before


def test_chunked_prefill_and_mixed_steps_run_eagerly_between_replays():
    target = cuda_tiny_target(torch.float32, seed=4)
    prompts, params = random_prompts(12, seed=4, low=10, high=40), _params(12, 24)
    want = _tokens(cuda_llm(target, enforce_eager=True), prompts, params)
    # buckets 1, 2, 4, 8; chunked prefill; prompts join the running requests' decode steps (mixed steps)
    llm = cuda_llm(target, max_num_seqs=12, max_num_batched_tokens=8, mixed_prefill=True)
    assert llm.engine.runner.graphs.target.buckets == [1, 2, 4, 8]
    with graph_runs() as (target_runs, _):
        assert _tokens(llm, prompts, params) == want
    assert target_runs and len(target_runs) < llm.engine.stats.num_steps


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_requests_arriving_mid_decode_leave_every_decode_step_on_its_graphs(k, monkeypatch):
    """The CUDA default (mixed prefill off): 8 requests of different lengths, at most 3 running, so
    each finish admits the next while the others decode. Every step that carries decode rows
    replays the target graph (a prompt gets a step of its own); answers equal enforce_eager's."""
    from blockdraft.runner.model_runner import ModelRunner

    target = cuda_tiny_target(torch.float32, seed=6)
    prompts = random_prompts(8, seed=21)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 17, 9, 30, 12, 3, 22, 8)]
    want = _tokens(cuda_llm(target, k, enforce_eager=True, max_num_seqs=3), prompts, params)
    decode_steps, sampled, launch = [], set(), ModelRunner.launch

    def recorded(self, so):
        ids = {sr.request_id for sr in so.requests}
        decode_steps.append(bool(ids & sampled))
        sampled.update(sr.request_id for sr in so.requests if sr.sample)
        return launch(self, so)

    monkeypatch.setattr(ModelRunner, "launch", recorded)
    llm = cuda_llm(target, k, max_num_seqs=3, async_scheduling=False)
    assert llm.engine.scheduler.config.mixed_prefill is False
    with graph_runs() as (target_runs, _):
        assert _tokens(llm, prompts, params) == want
    assert len(target_runs) == sum(decode_steps) and 0 < sum(decode_steps) < len(decode_steps)
    # async scheduling (the CUDA default) launches the waiting prompts' prefill ahead: same answers
    llm = cuda_llm(target, k, max_num_seqs=3)
    assert llm.engine.async_scheduling
    assert _tokens(llm, prompts, params) == want


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [None, 3, 15], ids=["plain", "k3", "k15"])
def test_newcomers_join_the_running_requests_before_their_prefill_is_read_back(dtype, k, monkeypatch):
    """The CUDA defaults (mixed prefill off, async scheduling), 12 requests through 3 sequence
    slots: each admission's prefill is launched ahead of reading a decode step back, and the
    uniform step in which the newcomers join the others is launched before the prefill is read
    back, their first token and drafts copied on the device (Scheduler.schedule_join). Same tokens
    as synchronous scheduling, greedy and seeded T > 0, including requests that stop in their
    prefill step (max_tokens 1); fp32 also == enforce_eager."""
    from blockdraft.runner.model_runner import ModelRunner

    target = cuda_tiny_target(dtype, seed=6)
    prompts = random_prompts(12, seed=22)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i, m in enumerate((5, 17, 9, 30, 12, 1, 22, 8, 1, 14, 2, 11))]  # fmt: skip
    want = _tokens(cuda_llm(target, k, max_num_seqs=3, async_scheduling=False), prompts, params)
    if dtype == torch.float32:
        assert want == _tokens(cuda_llm(target, k, enforce_eager=True, max_num_seqs=3), prompts, params)
    joined, original = [], ModelRunner.launch_join

    def counted(self, prev, so):
        out = original(self, prev, so)
        joined.append(out is not None)
        return out

    monkeypatch.setattr(ModelRunner, "launch_join", counted)
    llm = cuda_llm(target, k, max_num_seqs=3)
    assert llm.engine.async_scheduling and not llm.engine.scheduler.config.mixed_prefill
    assert _tokens(llm, prompts, params) == want
    assert sum(joined) >= 4


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_async_scheduling_equals_sync_scheduling(k, monkeypatch):
    """On by default with CUDA graphs: steps launched from the previous step's device output emit
    the same tokens and stops as synchronous steps (stops applied one step late)."""
    from blockdraft.runner.model_runner import ModelRunner

    target = cuda_tiny_target(torch.bfloat16, seed=2)
    prompts = random_prompts(7, seed=4)
    params = [SamplingParams(max_tokens=[12, 40, 25][i % 3], temperature=0.8 * (i % 2), seed=i,
                             stop_token_ids=[17] if i % 3 == 0 else []) for i in range(7)]  # fmt: skip
    sync = cuda_llm(target, k, async_scheduling=False)
    want = [(o.token_ids, o.finish_reason) for o in sync.generate(prompts, params)]
    continued, subsets, original = [], [], ModelRunner.launch_continuation
    def counted(self, prev, so):
        out = original(self, prev, so)
        continued.append(out is not None)
        subsets.append(out is not None and len(so.requests) < len(prev.so.requests))
        return out

    monkeypatch.setattr(ModelRunner, "launch_continuation", counted)
    llm = cuda_llm(target, k)
    assert llm.engine.async_scheduling
    assert [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)] == want
    assert sum(continued) > 10  # steps really launched from the previous step's device output
    assert sum(subsets) >= 1  # and on past requests that stopped (the others' rows gathered)


def test_captured_runner_samples_with_the_compiled_sampler_and_the_same_tokens():
    target = cuda_tiny_target(torch.bfloat16)
    prompts, params = random_prompts(9, seed=4), _params(9)
    llm = cuda_llm(target, None)
    assert llm.engine.runner.compiled_sampling  # on where CUDA graphs are captured
    compiled = _tokens(llm, prompts, params)
    llm.engine.runner.compiled_sampling = False
    assert _tokens(llm, prompts, params) == compiled
    assert not cuda_llm(target, None, graph_mode="eager").engine.runner.compiled_sampling


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [None, 15], ids=["plain", "k15"])
def test_single_request_prefill_graphs_equal_the_same_padded_step_run_eagerly(dtype, k):
    """Requests arriving one at a time prefill through the prefill graphs (runner.prefill_graphs):
    replay == the identical padded code run eagerly, and, in fp32, == the unpadded eager engine,
    with the same number of accepted drafts (the drafter's prefill context is the same)."""
    from blockdraft.runner.prefill_graphs import PrefillGraphs

    target = cuda_tiny_target(dtype, seed=5)
    prompts, params = random_prompts(6, seed=8, low=5, high=120), _params(6, 20)

    def one_at_a_time(llm):
        return [list(llm.generate([p], q)[0].token_ids) for p, q in zip(prompts, params)]

    want = one_at_a_time(cuda_llm(target, k, graph_mode="eager"))
    graphed = cuda_llm(target, k)
    prefill = graphed.engine.runner.graphs.prefill
    assert all(g.graph is not None for g in [*prefill.targets.values(), *prefill.tails.values()])
    runs, run = [], PrefillGraphs.run
    PrefillGraphs.run = lambda self, batch: runs.append(batch.num_rows) or run(self, batch)
    try:
        assert one_at_a_time(graphed) == want
    finally:
        PrefillGraphs.run = run
    assert sorted(runs) == sorted(len(p) for p in prompts)
    if dtype == torch.float32:
        eager = cuda_llm(target, k, enforce_eager=True)
        assert one_at_a_time(eager) == want
        if k is not None:
            assert graphed.engine.stats.spec.num_accepted_tokens == eager.engine.stats.spec.num_accepted_tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [None, 15], ids=["plain", "k15"])
def test_prefill_graphs_of_several_requests_equal_the_same_padded_step_run_eagerly(dtype, k):
    """2, 3, 4 and 5 requests arriving together prefill through the request buckets 2, 4, 4, 8 of
    the prefill graphs: replay == the identical padded code run eagerly (tokens and accepted drafts)."""
    from blockdraft.runner.prefill_graphs import PrefillGraphs

    target = cuda_tiny_target(dtype, seed=7)
    groups = [random_prompts(n, seed=20 + n, low=5, high=100) for n in (2, 3, 4, 5)]

    def together(llm):
        return [[list(o.token_ids) for o in llm.generate(g, _params(len(g), 20))] for g in groups]

    eager = cuda_llm(target, k, graph_mode="eager")
    want = together(eager)
    graphed = cuda_llm(target, k)
    runs, run = [], PrefillGraphs.run
    PrefillGraphs.run = lambda self, batch: runs.append((batch.num_reqs, batch.meta.num_reqs)) or run(self, batch)
    try:
        assert together(graphed) == want
    finally:
        PrefillGraphs.run = run
    assert runs == [(2, 2), (3, 4), (4, 4), (5, 8)]
    if k is not None:
        assert graphed.engine.stats.spec.num_accepted_tokens == eager.engine.stats.spec.num_accepted_tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [None, 15], ids=["plain", "k15"])
def test_a_burst_of_arrivals_prefills_in_graph_steps_within_the_largest_bucket(dtype, k):
    """12 requests arriving together (more than the largest prefill request bucket, 8): with graphs
    captured (mixed prefill off by default) they prefill as graph steps of 8 and 4 requests, not one
    eager step; replay == the identical padded code run eagerly with the same step limits."""
    from blockdraft.runner.prefill_graphs import PrefillGraphs

    target = cuda_tiny_target(dtype, seed=8)
    prompts = random_prompts(12, seed=33, low=5, high=40)
    eager = cuda_llm(target, k, graph_mode="eager", mixed_prefill=False)
    want = [list(o.token_ids) for o in eager.generate(prompts, _params(12, 20))]
    graphed = cuda_llm(target, k)
    assert graphed.engine.scheduler.config.max_prefill_seqs == 8
    runs, run = [], PrefillGraphs.run
    PrefillGraphs.run = lambda self, batch: runs.append((batch.num_reqs, batch.meta.num_reqs)) or run(self, batch)
    try:
        assert [list(o.token_ids) for o in graphed.generate(prompts, _params(12, 20))] == want
    finally:
        PrefillGraphs.run = run
    assert runs == [(8, 8), (4, 4)]
    if k is not None:
        assert graphed.engine.stats.spec.num_accepted_tokens == eager.engine.stats.spec.num_accepted_tokens



def test_the_cuda_default_budget_verifies_64_requests_at_k15_in_one_graphed_step():
    """Without max_num_batched_tokens, CUDA steps hold 8192 tokens (the CPU's 512 would fit only
    32 requests x 16 verify rows, so at 64 requests drafts were trimmed and steps ran eagerly):
    64 requests at K = 15 replay the 64-request bucket, output equal to plain greedy."""
    target = cuda_tiny_target(torch.float32, seed=7)
    prompts = random_prompts(64, seed=8)
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    plain = _tokens(cuda_llm(target, max_num_seqs=64), prompts, params)
    llm = cuda_llm(target, 15, max_num_seqs=64)
    assert llm.engine.scheduler.config.max_num_batched_tokens == 8192
    assert llm.engine.runner.graphs.target.buckets[-1] == 64
    with graph_runs() as (target_runs, _):
        assert _tokens(llm, prompts, params) == plain
    assert (64, 64) in target_runs, target_runs
