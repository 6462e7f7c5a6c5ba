"""Prefill steps of up to 4 requests padded to a request and row bucket (the code their CUDA graphs
capture), run eagerly on CPU with the dense sync-free backend: same tokens and drafts as the
unpadded path."""

import pytest

from blockdraft.runner.model_runner import ModelRunner
from blockdraft.runner.prefill_graphs import PrefillGraphs, prefill_request_sizes, prefill_sizes
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts, tiny_target

GRAPHS = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=16)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=4)


@pytest.fixture
def prefill_runs(monkeypatch):
    """(real rows, bucket rows) of every padded prefill step."""
    runs, run = [], PrefillGraphs.run

    def recorded(self, batch):
        runs.append((batch.num_rows, batch.input_ids.shape[0]))
        return run(self, batch)

    monkeypatch.setattr(PrefillGraphs, "run", recorded)
    return runs


def _spec_llm(target, k, **kw):
    drafter = random_drafter(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), seed=k, init_std=0.1)
    return make_llm(target, speculator=DFlashSpeculator(drafter, target.model, k, None, 4), **kw)


def _one_at_a_time(llm, prompts, params):
    """Each prompt arrives alone (its prefill is a single-request step)."""
    return [list(llm.generate([p], q)[0].token_ids) for p, q in zip(prompts, params)]


def test_buckets_are_powers_of_two_from_16_up_to_the_step_budget():
    assert prefill_sizes(8192) == [16, 32, 64, 128, 256, 512, 1024]
    assert prefill_sizes(100) == [16, 32, 64]
    assert prefill_sizes(8) == []
    assert prefill_sizes(8192, largest=64) == [16, 32, 64]
    assert prefill_request_sizes(64) == [1, 2, 4, 8]
    assert prefill_request_sizes(6) == [1, 2, 4, 6]
    assert prefill_request_sizes(3) == [1, 2, 3]
    assert prefill_request_sizes(1) == [1]


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_single_request_prefill_padded_to_a_bucket_equals_the_normal_path(target, prefill_runs, k):
    prompts = random_prompts(4, seed=40, low=5, high=40)
    params = [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    build = (lambda **kw: make_llm(target, **kw)) if k is None else (lambda **kw: _spec_llm(target, k, **kw))
    plain = _one_at_a_time(make_llm(target), prompts, params)
    eager_llm = build()
    padded_llm = build(**GRAPHS)
    assert _one_at_a_time(eager_llm, prompts, params) == plain
    assert _one_at_a_time(padded_llm, prompts, params) == plain
    assert sorted(rows for rows, _ in prefill_runs) == sorted(len(p) for p in prompts)
    assert all(bucket in (16, 32, 64) and rows <= bucket for rows, bucket in prefill_runs)
    if k is not None:  # the drafter's context and first block after a padded prefill are the same too
        assert padded_llm.engine.stats.spec.num_drafted_tokens == eager_llm.engine.stats.spec.num_drafted_tokens
        assert padded_llm.engine.stats.spec.num_accepted_tokens == eager_llm.engine.stats.spec.num_accepted_tokens


def test_long_prompts_batches_and_cached_prefixes(target, prefill_runs):
    """A prompt beyond the largest bucket runs the eager path, three requests prefill as one padded
    step; a prompt whose prefix is cached pads only its uncached rows (seq_len > rows)."""
    long_prompt = random_prompts(1, seed=41, low=70, high=71)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [list(o.token_ids) for o in make_llm(target).generate([long_prompt], params)]
    llm = make_llm(target, max_num_batched_tokens=64, **GRAPHS)  # buckets 16, 32, 64; chunked prefill
    assert [list(o.token_ids) for o in llm.generate([long_prompt], params)] == want
    assert prefill_runs == [(6, 16)]  # only the last chunk (70 = 64 + 6) sampled
    prefill_runs.clear()
    prompts = random_prompts(3, seed=42)
    assert [list(o.token_ids) for o in llm.generate(prompts, params)] == [
        list(o.token_ids) for o in make_llm(target).generate(prompts, params)]
    assert prefill_runs == [(sum(map(len, prompts)), 64)]  # three requests in one step (request bucket 4)
    cached = make_llm(target, enable_prefix_caching=True, **GRAPHS)
    base = random_prompts(1, seed=43, low=30, high=31)[0]
    cached.generate([base + [5, 6]], params)
    prefill_runs.clear()
    got = cached.generate([base + [7, 8, 9]], params)
    assert list(got[0].token_ids) == list(make_llm(target).generate([base + [7, 8, 9]], params)[0].token_ids)
    assert prefill_runs and prefill_runs[0][0] < 33  # the cached full pages were not recomputed


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_prefill_steps_of_several_requests_padded_to_a_bucket_equal_the_normal_path(target, monkeypatch, k):
    """2, 3, 4 and 5 prompts admitted together replay the request buckets 2, 4, 4, 8 (padding
    requests inert: the real requests' tokens, drafts and accepted counts are unchanged); 9 (more
    than the largest bucket) run eagerly."""
    runs, run = [], PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, batch: runs.append((batch.num_reqs, batch.meta.num_reqs))
                        or run(self, batch))  # fmt: skip
    cases = []
    for n, seed in ((2, 50), (3, 51), (4, 52), (5, 53), (9, 54)):
        prompts = random_prompts(n, seed=seed, low=5, high=40)
        params = [SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(n)]
        cases.append((prompts, params, [list(o.token_ids) for o in make_llm(target).generate(prompts, params)]))
    # built after the reference runs: an LLM sets the shared target's attention backend
    build = (lambda **kw: make_llm(target, **kw)) if k is None else (lambda **kw: _spec_llm(target, k, **kw))
    eager_llm, padded_llm = build(), build(**GRAPHS)
    drafts, finish = {}, ModelRunner.finish

    def recorded(self, step):  # every step's drafts per request, in step order
        out = finish(self, step)
        drafts.setdefault(id(self), []).append(dict(out.draft_token_ids))
        return out

    monkeypatch.setattr(ModelRunner, "finish", recorded)
    for prompts, params, want in cases:
        assert [list(o.token_ids) for o in eager_llm.generate(prompts, params)] == want
        assert [list(o.token_ids) for o in padded_llm.generate(prompts, params)] == want
    assert runs == [(2, 2), (3, 4), (4, 4), (5, 8)]
    # the drafts of each step, the prefill steps' first blocks included, are the eager engine's
    assert drafts[id(padded_llm.engine.runner)] == drafts[id(eager_llm.engine.runner)]
    assert k is None or any(d for d in drafts[id(padded_llm.engine.runner)][0].values())


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_a_burst_beyond_the_largest_prefill_graph_prefills_in_graphed_steps(target, monkeypatch, k):
    """Without mixed prefill, 12 short prompts arriving together (more than the largest request
    bucket, 8) prefill as graph steps of 8 and 4 requests; 4 prompts of 20-31 tokens under a
    64-token budget (64-row largest bucket) prefill whole, as many per step as fit (a third prompt
    would join as a chunk, and the step would run eagerly). Tokens as plain eager decoding."""
    runs, run = [], PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, batch: runs.append((batch.num_reqs, batch.num_rows))
                        or run(self, batch))  # fmt: skip
    build = (lambda **kw: make_llm(target, **kw)) if k is None else (lambda **kw: _spec_llm(target, k, **kw))
    short, long = random_prompts(12, seed=60, low=3, high=12), random_prompts(4, seed=61, low=20, high=35)
    assert [len(p) for p in long] == [21, 26, 20, 31]  # 21 + 26 + 20 > 64: without the limit, 17 rows of the third
    for prompts, budget, want_runs in ((short, 512, [(8, sum(map(len, short[:8]))), (4, sum(map(len, short[8:])))]),
                                       (long, 64, [(2, 47), (2, 51)])):
        params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
                  for i in range(len(prompts))]
        want = [list(o.token_ids) for o in build().generate(prompts, params)]
        runs.clear()
        padded = build(mixed_prefill=False, max_num_batched_tokens=budget, **GRAPHS)
        assert [list(o.token_ids) for o in padded.generate(prompts, params)] == want
        assert runs == want_runs


def test_logprobs_of_a_padded_prefill_step(target, prefill_runs):
    prompt = random_prompts(1, seed=44)[0]
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)
    want = make_llm(target).generate([prompt], params)[0].logprobs
    got = make_llm(target, **GRAPHS).generate([prompt], params)[0].logprobs
    assert prefill_runs
    assert [d["token_id"] for d in got] == [d["token_id"] for d in want]
    assert [t for t, _ in got[0]["top"]] == [t for t, _ in want[0]["top"]]
    assert got[0]["logprob"] == pytest.approx(want[0]["logprob"], abs=1e-4)



def test_dflash_prefill_graphs_with_chunks_and_cached_prefixes(target, prefill_runs):
    """The drafter's context after a chunked or prefix-cached prompt is the same through the padded
    prefill step: same tokens and the same drafts as the eager speculator."""
    long_prompt = random_prompts(1, seed=45, low=70, high=71)[0]
    base = random_prompts(1, seed=46, low=30, high=31)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [long_prompt, base + [5, 6], base + [7, 8, 9]]
    want = _one_at_a_time(make_llm(target), prompts, [params] * 3)
    kw = dict(max_num_batched_tokens=64, enable_prefix_caching=True)
    eager = _spec_llm(target, 3, **kw)
    padded = _spec_llm(target, 3, **kw, **GRAPHS)
    assert _one_at_a_time(eager, prompts, [params] * 3) == want
    assert _one_at_a_time(padded, prompts, [params] * 3) == want
    assert [rows for rows, _ in prefill_runs][0] == 6  # the long prompt's last chunk
    assert prefill_runs[-1][0] < 33  # the third prompt's cached pages were not recomputed
    assert padded.engine.stats.spec.num_drafted_tokens == eager.engine.stats.spec.num_drafted_tokens
    assert padded.engine.stats.spec.num_accepted_tokens == eager.engine.stats.spec.num_accepted_tokens


def test_logprobs_of_padded_verify_steps(target):
    """Log-probabilities read from the static logits of padded verify steps (and the padded
    prefill) equal the eager speculative engine's."""
    prompts = random_prompts(3, seed=47)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    want = _spec_llm(target, 3).generate(prompts, params)
    got = _spec_llm(target, 3, **GRAPHS).generate(prompts, params)
    for a, b in zip(got, want):
        assert [d["token_id"] for d in a.logprobs] == [d["token_id"] for d in b.logprobs] == list(b.token_ids)
        assert [d["logprob"] for d in a.logprobs] == pytest.approx([d["logprob"] for d in b.logprobs], abs=1e-4)


def test_a_smaller_prefill_bucket_after_a_larger_one_reads_no_stale_row(target):
    """4 prompts of ~15 tokens (bucket 4 x 64), then 3 of 3 tokens (bucket 4 x 16): the padding
    request's logits row must not be the first step's (row ~60, past the 16 rows of the second)."""
    first = random_prompts(4, seed=60, low=14, high=16)
    second = random_prompts(3, seed=61, low=3, high=4)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = [[list(o.token_ids) for o in make_llm(target).generate(p, params)] for p in (first, second)]
    padded = make_llm(target, **GRAPHS)
    assert [[list(o.token_ids) for o in padded.generate(p, params)] for p in (first, second)] == want
