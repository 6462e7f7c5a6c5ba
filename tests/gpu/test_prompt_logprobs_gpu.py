"""SamplingParams.prompt_logprobs on the GPU path (CUDA graphs, async scheduling, Triton attention):
steps that score prompt rows run eagerly, the others keep replaying graphs; the output tokens are
those of requests without prompt_logprobs, plain and DFlash, and the prompt log-probabilities equal
a full forward of the prompt (on the CPU, the same weights), across chunked prefill, fp32.
`python -m pytest -q tests/gpu/test_prompt_logprobs_gpu.py`."""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.engine.test_prompt_logprobs import assert_prompt_logprobs  # noqa: E402
from tests.gpu.runner_util import cuda_llm, cuda_tiny_target, graph_runs  # noqa: E402

pytestmark = [pytest.mark.gpu]


def _params(n: int, prompt_logprobs: bool) -> list[SamplingParams]:
    """Greedy and seeded T = 0.8 requests; every other one asks for 3 prompt alternatives."""
    return [SamplingParams(max_tokens=[5, 30, 12][i % 3], ignore_eos=True, temperature=0.8 * (i % 2), seed=i,
                           prompt_logprobs=3 if prompt_logprobs and i % 3 != 1 else None) for i in range(n)]


@pytest.mark.parametrize("k", [None, 5], ids=["plain", "dflash-k5"])
def test_prompt_logprobs_with_graphs_and_async_scheduling(k):
    target = cuda_tiny_target(torch.float32, seed=6)
    cpu_model = copy.deepcopy(target.model).to("cpu")
    prompts = random_prompts(9, seed=12, low=10, high=150)  # 64-token steps: most prompts take chunks
    want = cuda_llm(target, k, max_num_batched_tokens=64).generate(prompts, _params(9, False))
    llm = cuda_llm(target, k, max_num_batched_tokens=64)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs_captured
    with graph_runs() as (target_runs, _):
        outs = llm.generate(prompts, _params(9, True))
    assert target_runs  # decode steps still replay graphs
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    for prompt, p, out in zip(prompts, _params(9, True), outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(out.prompt_logprobs, cpu_model, prompt, 3, atol=2e-3)
