"""The whole engine over the Triton kernels (attention, K/V writes, draft input preparation), run
by Triton's interpreter on CPU: the GPU step's kernel wiring, padded graph buckets included, emits
the reference tokens. Tiny shapes (the interpreter is slow); run on its own if triton was
imported before (see tests/triton_interp.py)."""

from tests.triton_interp import numpy_index_shim, require_interpreter  # noqa: F401  (autouse fixture)

require_interpreter("blockdraft.attention.triton_attention", "blockdraft.spec.dflash.prepare_inputs_triton")

import pytest  # noqa: E402

from blockdraft.attention.backends import AttentionBackendSpec  # noqa: E402
from blockdraft.attention.triton_attention import paged_attention_triton, write_kv_triton  # noqa: E402
from blockdraft.sampling_params import SamplingParams  # noqa: E402
from blockdraft.spec.dflash.checkpoint import random_drafter  # noqa: E402
from blockdraft.spec.dflash.speculator import DFlashSpeculator  # noqa: E402
from tests.conftest import make_llm, random_prompts, tiny_target  # noqa: E402

TRITON = AttentionBackendSpec("triton", paged_attention_triton, write_kv_triton, host_metadata=False)


@pytest.mark.parametrize("graph_mode", ["off", "eager"])
def test_speculative_engine_on_triton_kernels_equals_the_reference(graph_mode):
    target = tiny_target("qwen3", seed=7, num_hidden_layers=2)
    prompts = random_prompts(3, seed=8, low=3, high=8)
    params = [SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.9 * (i % 2), seed=i) for i in range(3)]
    want = [o.token_ids for o in make_llm(target).generate(prompts, params)]
    drafter = random_drafter(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 1), seed=1, init_std=0.1)
    spec = DFlashSpeculator(drafter, target.model, 3, None, 4)
    llm = make_llm(target, speculator=spec, attention_backend=TRITON, graph_mode=graph_mode, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats.spec.num_drafted_tokens > 0
