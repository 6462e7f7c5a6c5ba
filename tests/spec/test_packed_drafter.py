"""On the CPU the LLM packs the drafter's linears for oneDNN like the target's: same projections,
same output as plain decoding; training and export keep working on unpacked drafters."""

import pytest
import torch

from blockdraft.layers.linear import cpu_packing_supported
from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import load_drafter
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

pytestmark = pytest.mark.skipif(not cpu_packing_supported(torch.float32, "cpu"), reason="no oneDNN packing here")


def test_llm_packs_the_drafter_on_the_cpu_with_the_same_math_and_lossless_output(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    folder = write_tiny_drafter(tmp_path / "drafter", model, block_size=4)
    pool = dict(num_kv_blocks=128, kv_block_size=4)
    prompts = [[{"role": "user", "content": f"w{i:02d}x w{i + 5:02d}x"}] for i in range(1, 4)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(model=str(model), **pool).generate(prompts, params)]
    spec = LLM(model=str(model), draft=str(folder), **pool)
    packed = spec.speculator.drafter
    assert packed.packed and packed.fc.weight is None and packed.layers[0].mlp.down_proj.weight is None
    assert packed.dtype == torch.float32 and packed.device.type == "cpu"
    assert not packed.pack_for_cpu_inference()  # packed once
    assert [o.token_ids for o in spec.generate(prompts, params)] == want

    dense = load_drafter(folder, spec.target.config, dtype=torch.float32)
    assert not dense.packed
    features = torch.randn(5, packed.fc.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(packed.project_context(features), dense.project_context(features),
                                   rtol=1e-5, atol=1e-5)
        x = torch.randn(3, packed.config.hidden_size, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(packed.layers[0].mlp(x), dense.layers[0].mlp(x), rtol=1e-5, atol=1e-5)


def test_packing_is_a_no_op_off_the_cpu_path_dtypes():
    from blockdraft.spec.dflash.checkpoint import random_drafter
    from tests.conftest import tiny_config

    half = random_drafter(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=(0, 2)).half()
    assert not half.pack_for_cpu_inference() and not half.packed and half.fc.weight is not None
