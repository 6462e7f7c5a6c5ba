"""CPU and CUDA give identical noise and identical samples for identical logits (skipped without CUDA)."""

import pytest
import torch

from blockdraft.sample import SamplingTensors, compute_logprobs, keyed_uniform, sample
from blockdraft.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_keyed_uniform_bit_identical_on_cuda():
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-(2**63), 2**63 - 1, (200,), generator=g), torch.tensor([0, -1, 2**63 - 1])])
    pos = torch.randint(0, 2**40, (203,), generator=g)
    for dtype in (torch.float32, torch.float64):
        cpu = keyed_uniform(seeds, pos, 50_000, dtype=dtype)
        gpu = keyed_uniform(seeds.cuda(), pos.cuda(), 50_000, dtype=dtype)
        assert torch.equal(cpu, gpu.cpu())


def test_sample_identical_on_cuda():
    g = torch.Generator().manual_seed(1)
    n, v = 96, 32_000
    logits = torch.randn(n, v, generator=g) * 3
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=50),
        dict(temperature=1.2, top_p=0.9),
        dict(temperature=0.8, top_k=100, top_p=0.8),
        dict(temperature=0.6, top_p=0.95),
        dict(temperature=1.1, min_p=0.1),
        dict(temperature=0.9, top_k=80, top_p=0.9, min_p=0.05),
    ]
    params = [SamplingParams(seed=i * 7919, **kinds[i % len(kinds)]) for i in range(n)]
    pos = torch.randint(0, 10_000, (n,), generator=g)
    st = SamplingTensors.from_params(params)
    cpu = st.sample(logits, pos)
    stg = SamplingTensors.from_params(params, device="cuda")
    gpu = stg.sample(logits.cuda(), pos.cuda())
    assert gpu.device.type == "cuda"
    # Identical except where two perturbed logits are within float rounding (transcendentals may differ
    # by an ulp between devices): in practice none.
    assert (cpu != gpu.cpu()).sum().item() == 0
    lp_c, ids_c, _ = compute_logprobs(logits, cpu, 5)
    lp_g, ids_g, _ = compute_logprobs(logits.cuda(), gpu, 5)
    assert torch.allclose(lp_c, lp_g.cpu(), atol=1e-5) and torch.equal(ids_c, ids_g.cpu())


def test_compiled_noise_path_matches_eager_on_cuda():
    g = torch.Generator().manual_seed(2)
    for n, v in ((8, 151_936), (33, 32_000)):  # two shapes: dynamic=True must not need a recompile per shape
        logits = torch.randn(n, v, generator=g).cuda() * 2
        params = [SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, top_k=40 if i % 3 == 0 else 0,
                                 min_p=0.05 if i % 4 == 1 else 0.0, seed=i) for i in range(n)]  # fmt: skip
        st = SamplingTensors.from_params(params, device="cuda")
        pos = torch.arange(n, device="cuda") * 31
        assert torch.equal(st.sample(logits, pos, compiled=True), st.sample(logits, pos))
        st1 = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=5)] * n, device="cuda")
        assert torch.equal(st1.sample(logits, pos, compiled=True), st1.sample(logits, pos))


def test_sample_never_syncs_with_the_host():
    g = torch.Generator().manual_seed(3)
    n, v = 24, 50_000
    logits = torch.randn(n, v, generator=g).cuda()
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_k=[0, 20][i % 2], top_p=[1.0, 0.9, 0.8][i % 3],
                             min_p=[0.0, 0.1][i % 4 == 3], seed=i) for i in range(n)]  # fmt: skip
    st = SamplingTensors.from_params(params, device="cuda")
    only_min_p = SamplingTensors.from_params([SamplingParams(temperature=1.0, min_p=0.2, seed=1)] * n, device="cuda")
    pos = torch.arange(n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st.sample(logits, pos)
        sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, pos)
        sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, pos, min_p=st.min_p)
        only_min_p.sample(logits, pos)  # min-p without top-k / top-p: the row maximum, no sort
        compute_logprobs(logits, pos, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
