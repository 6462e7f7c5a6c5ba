"""Prefix caching with async scheduling and the padded (CUDA-graph) step code, run eagerly on CPU
(graph_mode="eager", dense backend; as tests/engine/test_async_scheduling.py). A hit is a prefill
chunk at start_position > 0 (eager), then the uniform chain continues as usual. An oracle drafter
makes many drafts accepted, so pages filled by accepted drafts get cached and reused."""

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts, tiny_target
from tests.engine.test_async_scheduling import GRAPHS, _count_continuations, _oracle_speculator


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, logit_scale=8.0)  # as test_async_scheduling's


def _two_rounds(llm, first, params):
    """Round 1: the prompts; round 2: each conversation's next turn (prompt + answer + 3 tokens)."""
    one = [o.token_ids for o in llm.generate(first, params)]
    second = [p + a + [5, 6, 7] for p, a in zip(first, one)]
    return one, [o.token_ids for o in llm.generate(second, params)], second


def test_async_speculative_with_prefix_hits_equals_plain(target, monkeypatch):
    prefix = random_prompts(1, seed=40, low=21, high=22)[0]
    first = [prefix + t for t in random_prompts(4, seed=41, low=1, high=7)]
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    want1, want2, second = _two_rounds(make_llm(target), first, params)
    full = make_llm(target).generate(first + second, SamplingParams(max_tokens=60, ignore_eos=True))
    sequences = [p + o.token_ids for p, o in zip(first + second, full)]
    counts = _count_continuations(monkeypatch)
    llm = make_llm(target, speculator=_oracle_speculator(target, 3, sequences), **GRAPHS, async_scheduling=True,
                   enable_prefix_caching=True)
    got1, got2, _ = _two_rounds(llm, first, params)
    assert (got1, got2) == (want1, want2)
    stats = llm.engine.scheduler.kv.stats
    # round 1 admits all 4 in one step, before any page is committed: no hits; round 2 reuses the
    # committed pages of each conversation (prompt + answer but the answer's uncomputed last token)
    assert stats.hits >= 4 * 40
    assert counts["continued"] > 5 and llm.engine.stats.spec.num_accepted_tokens > 0
