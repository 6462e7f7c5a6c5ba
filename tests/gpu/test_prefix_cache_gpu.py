"""Prefix caching on the GPU path (CUDA graphs, async scheduling, Triton attention): requests that
start from cached pages give the same tokens as without the cache, plain and DFlash, greedy and
seeded sampling, fp32. `python -m pytest -q tests/gpu/test_prefix_cache_gpu.py`."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.gpu.runner_util import cuda_llm, cuda_tiny_target, graph_runs  # noqa: E402

pytestmark = [pytest.mark.gpu]


def _shared(n: int, seed: int, prefix_len: int = 70) -> list[list[int]]:
    """n prompts: one shared 70-token prefix (4 full pages of 16) + a tail of 3-20 tokens each."""
    prefix = random_prompts(1, seed=seed, low=prefix_len, high=prefix_len + 1)[0]
    return [prefix + tail for tail in random_prompts(n, seed=seed + 1)]


def _params(n: int) -> list[SamplingParams]:
    """Greedy and seeded T = 0.8 requests, alternating, with stop ids that may land mid-block."""
    return [SamplingParams(max_tokens=40, temperature=0.8 if i % 2 else 0.0, seed=i, stop_token_ids=[7, 11])
            for i in range(n)]


@pytest.mark.parametrize("k", [None, 5], ids=["plain", "dflash-k5"])
def test_cached_prefix_gives_the_same_tokens_with_graphs_and_async(k):
    target = cuda_tiny_target(torch.float32, seed=5)
    first, second = _shared(6, seed=10), _shared(8, seed=10)[2:]  # same prefix; the second batch new tails
    reference = cuda_llm(target, k)
    want = [[o.token_ids for o in reference.generate(batch, _params(len(batch)))] for batch in (first, second)]
    llm = cuda_llm(target, k, enable_prefix_caching=True)
    assert llm.engine.async_scheduling  # the default on CUDA with graphs
    kv = llm.engine.scheduler.kv
    assert [o.token_ids for o in llm.generate(first, _params(len(first)))] == want[0]
    hits_first = kv.stats.hits
    with graph_runs() as (target_runs, draft_runs):
        assert [o.token_ids for o in llm.generate(second, _params(len(second)))] == want[1]
    assert kv.stats.hits - hits_first >= len(second) * 64  # every request reused the prefix's 4 pages
    assert target_runs and (k is None) == (not draft_runs)  # decode steps replayed graphs


def test_reset_prefix_cache_on_the_gpu_path_recomputes_with_the_same_tokens():
    target = cuda_tiny_target(torch.float32, seed=6)
    prompts = _shared(4, seed=20)
    llm = cuda_llm(target, 3, enable_prefix_caching=True)
    once = [o.token_ids for o in llm.generate(prompts, _params(4))]
    hits = llm.engine.scheduler.kv.stats.hits
    assert [o.token_ids for o in llm.generate(prompts, _params(4))] == once
    assert llm.engine.scheduler.kv.stats.hits > hits
    assert llm.reset_prefix_cache()
    hits = llm.engine.scheduler.kv.stats.hits
    assert [o.token_ids for o in llm.generate(prompts, _params(4))] == once
    assert llm.engine.scheduler.kv.stats.hits == hits
