"""Whole models on CUDA: fused ops on == off, and a bound on the kernels one decode layer launches.

The fused path must decode the same greedy tokens in fp32 and be as accurate as the torch path in
bf16 (both measured against an fp32 run with the same bf16-representable weights). The kernel
count is what the fused ops are for: a regression there is a silent slowdown, so it is pinned.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 would run the kernels in the interpreter", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.attention.metadata import build_metadata  # noqa: E402
from blockdraft.bench import layer_ops  # noqa: E402
from blockdraft.layers.fused_ops import set_fused_ops  # noqa: E402
from blockdraft.spec.dflash.checkpoint import random_drafter  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.layers.fused_cases import cast_copy, decode, random_target  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35]]
STEPS = 4
QWEN25_05B = layer_ops.PRESETS["qwen2.5-0.5b"]
QWEN3_8B = layer_ops.PRESETS["qwen3-8b"]


def models() -> dict:
    return {
        "tiny-llama": tiny_config("llama", num_hidden_layers=3),
        "tiny-qwen2": tiny_config("qwen2", num_hidden_layers=3),
        "tiny-qwen3": tiny_config("qwen3", num_hidden_layers=3),
        "qwen2.5-0.5b-shaped": QWEN25_05B,
    }


@pytest.mark.parametrize("name", sorted(models()))
def test_fp32_greedy_tokens_and_logits(name):
    config = models()[name]
    model = random_target(config, torch.float32, "cuda", std=0.02 if config is QWEN25_05B else 0.08)
    aux_ids = (0, config.num_hidden_layers - 1)
    plain = decode(set_fused_ops(model, False), PROMPTS, STEPS, aux_layer_ids=aux_ids)
    fused = decode(set_fused_ops(model, True), PROMPTS, STEPS, aux_layer_ids=aux_ids)
    assert torch.equal(fused.tokens, plain.tokens)
    torch.testing.assert_close(fused.logits, plain.logits, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(fused.aux, plain.aux, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", sorted(models()))
def test_bf16_is_as_accurate_as_the_torch_path(name):
    config = models()[name]
    bf16 = random_target(config, torch.bfloat16, "cuda", std=0.02 if config is QWEN25_05B else 0.08)
    ref = decode(cast_copy(bf16, torch.float32), PROMPTS, STEPS)  # exact math on the same weights
    plain = decode(set_fused_ops(bf16, False), PROMPTS, STEPS, forced=ref.tokens[:, :STEPS])
    fused = decode(set_fused_ops(bf16, True), PROMPTS, STEPS, forced=ref.tokens[:, :STEPS])
    err_plain = (plain.logits - ref.logits).abs()
    err_fused = (fused.logits - ref.logits).abs()
    assert float(err_fused.max()) <= 2 * float(err_plain.max()) + 1e-3
    assert float(err_fused.mean()) <= 1.5 * float(err_plain.mean()) + 1e-4
    # Where the exact run is decisive, both bf16 paths pick its token.
    top2 = ref.logits.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 4 * float(err_plain.max())
    assert torch.equal(fused.tokens.T[decisive], ref.tokens.T[decisive])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drafter_fused_matches_torch_path(dtype):
    target = dataclasses.replace(QWEN3_8B, num_hidden_layers=8, layer_types=(), hidden_size=1024,
                                 intermediate_size=3072, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    drafter = random_drafter(target, num_layers=2, block_size=8, init_std=0.05, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    feats = torch.randn(20, drafter.config.num_aux_layers * 1024, generator=gen, device="cuda")
    block = torch.randn(16, 1024, generator=gen, device="cuda")
    outs = []
    for enabled in (False, True):
        set_fused_ops(drafter, enabled)
        caches = drafter.allocate_kv_caches(8, 4)
        slots = torch.cat([torch.arange(10), torch.arange(12, 22)]).cuda()  # pages 0-2 and 3-5
        drafter.write_context(feats, torch.arange(20, device="cuda") % 10, caches, slots)
        meta = build_metadata([10, 10], [8, 8], [[0, 1, 2], [3, 4, 5]], 4, num_block_tokens=8, device="cuda")
        positions = torch.arange(10, 18, device="cuda").repeat(2)
        outs.append((drafter(block, positions, caches, meta).float(), caches[1][0].float()))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(outs[1][0], outs[0][0], **tol)
    torch.testing.assert_close(outs[1][1], outs[0][1], **tol)


# Kernels per decoder layer with the fused ops, attention excluded (its backends count their own),
# for the 4 rows of these decode steps on the H200: 2 fused add+RMSNorm, 1 q/k norm + RoPE, the
# gate/up projection with silu*up in its launch (ours, 2-16 rows of these shapes), and 3 more GEMMs
# (qkv, o, down), each of which cuBLAS may split into a main kernel plus a split-K reduction or bias
# epilogue (bounded as 4 GEMMs of 2 kernels).
OUR_KERNELS_PER_LAYER = {"_rms_norm_kernel": 2, "_qk_norm_rope_kernel": 1, "_skinny_swiglu_kernel": 1,
                         "_silu_mul_kernel": 0}  # fmt: skip
MAX_KERNELS_PER_LAYER = sum(OUR_KERNELS_PER_LAYER.values()) + 4 * 2


def _step_kernels(config, num_layers: int, fused: bool) -> list[str]:
    config = dataclasses.replace(config, num_hidden_layers=num_layers, layer_types=(), vocab_size=1024)
    model = set_fused_ops(layer_ops.random_model(config), fused)
    layer_ops.set_attention_backend(model, layer_ops.skip_attention)
    step = layer_ops.decode_step(model, batch=4, context=64)
    with torch.inference_mode():
        step()
        return layer_ops.count_cuda_kernels(step)


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen2.5-0.5b"])
def test_decode_layer_kernel_count(preset):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the counts assume the sm90 skinny-GEMM tables (the gate/up + activation launch)")
    config = layer_ops.PRESETS[preset]
    one, two = _step_kernels(config, 1, True), _step_kernels(config, 2, True)
    per_layer = len(two) - len(one)
    unfused = len(_step_kernels(config, 2, False)) - len(_step_kernels(config, 1, False))
    detail = f"{per_layer} kernels per fused layer (torch path: {unfused}); one step of 2 layers: {two}"
    assert per_layer <= MAX_KERNELS_PER_LAYER, detail
    for name, count in OUR_KERNELS_PER_LAYER.items():
        launched = sum(k.startswith(name) for k in two) - sum(k.startswith(name) for k in one)
        assert launched == count, f"{name}: {launched} per layer, expected {count}; {detail}"


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen2.5-0.5b"])
def test_the_rope_kernel_writes_kv_instead_of_a_separate_launch(preset):
    """With the Triton attention backend a decode layer launches no `_write_kv_kernel`: the q/k
    norm + RoPE kernel writes the K/V (`kv_written`); with the ops off the backend writes them."""
    from blockdraft.attention.triton_attention import paged_attention_triton

    config = dataclasses.replace(layer_ops.PRESETS[preset], num_hidden_layers=2, layer_types=(), vocab_size=1024)
    for fused, expected_writes in ((True, 0), (False, 2)):
        model = set_fused_ops(layer_ops.random_model(config), fused)
        layer_ops.set_attention_backend(model, paged_attention_triton)
        step = layer_ops.decode_step(model, batch=4, context=64)
        with torch.inference_mode():
            step()
            kernels = layer_ops.count_cuda_kernels(step)
        assert sum(k.startswith("_write_kv_kernel") for k in kernels) == expected_writes, kernels
        assert sum(k.startswith("_qk_norm_rope_kernel") for k in kernels) == (2 if fused else 0), kernels


def test_layer_ops_benchmark_runs(tmp_path):
    out = tmp_path / "layer_ops.json"
    layer_ops.main(["--preset", "qwen2.5-0.5b", "--layers", "2", "--batch", "2", "--context", "32",
                    "--iters", "3", "--warmup", "1", "--attention", "skip", "dense", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    rows = report["results"]
    expected = [("skip", False), ("skip", True), ("dense", False), ("dense", True)]
    assert [(r["attention"], r["fused"]) for r in rows] == expected
    assert all(r["graph_ms"] > 0 and r["eager_ms"] > 0 for r in rows)
