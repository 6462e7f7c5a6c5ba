"""KV pool sized from GPU memory: profile step, budget, explicit num_kv_blocks wins, impossible
budgets fail at start naming the knob."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.llm import LLM  # noqa: E402
from blockdraft.runner.kv_budget import kv_bytes_per_page  # noqa: E402
from blockdraft.sampling_params import SamplingParams  # noqa: E402
from blockdraft.spec.dflash.checkpoint import random_drafter  # noqa: E402
from blockdraft.spec.dflash.speculator import DFlashSpeculator  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.gpu.runner_util import cuda_llm, cuda_tiny_target  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]
GIB = 1 << 30


def _utilization_leaving(extra_bytes: int) -> float:
    """The utilization whose budget is what is in use now plus `extra_bytes`."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free + extra_bytes) / total


def test_pool_fills_the_budget_with_target_and_drafter_pages():
    target = cuda_tiny_target(torch.bfloat16)
    drafter = random_drafter(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), seed=0,
                             dtype=torch.bfloat16, device="cuda")  # fmt: skip
    spec = DFlashSpeculator(drafter, target.model, 7, None, 16)
    llm = LLM(target=target, device="cuda", speculator=spec, num_kv_blocks=None, kv_block_size=16,
              gpu_memory_utilization=_utilization_leaving(GIB))  # fmt: skip
    cfg = target.config
    per_page = kv_bytes_per_page(16, [(cfg.num_key_value_heads, cfg.head_dim)] * (cfg.num_hidden_layers + 2), 2)
    pages = llm.engine.scheduler.kv.num_blocks
    assert 0.5 * GIB < pages * per_page <= GIB  # the tiny model's activations are far below 0.5 GiB
    assert spec.kv_caches[0][0].shape[0] == pages == llm.engine.runner.kv_caches[0][0].shape[0]
    out = llm.generate(random_prompts(4, seed=1), SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in out)


def test_explicit_num_kv_blocks_wins():
    llm = cuda_llm(cuda_tiny_target(torch.bfloat16), num_kv_blocks=37, gpu_memory_utilization=0.01)
    assert llm.engine.scheduler.kv.num_blocks == 37


def test_a_budget_below_one_request_fails_at_start_naming_the_knob():
    target = cuda_tiny_target(torch.bfloat16)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        # A budget of exactly what is in use now: nothing left for activations, let alone pages.
        LLM(target=target, device="cuda", num_kv_blocks=None, gpu_memory_utilization=_utilization_leaving(0))
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be in"):
        LLM(target=target, device="cuda", num_kv_blocks=None, gpu_memory_utilization=1.5)
