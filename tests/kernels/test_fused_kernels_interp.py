"""Fused-op Triton kernels == their torch twins, on CPU through Triton's interpreter.

Tiny shapes (the interpreter is slow). The compiled kernels at real shapes are checked under
tests/gpu. Triton 3.6's interpreter truncates fp32 -> bf16 casts (the compiled kernels round to
nearest even), so `bf16_rounding` makes the interpreter round like the GPU for these tests.
"""

from __future__ import annotations

from tests.triton_interp import require_interpreter

KERNEL_MODULES = ("blockdraft.kernels.rms_norm", "blockdraft.kernels.rope", "blockdraft.kernels.activation")
require_interpreter(*KERNEL_MODULES)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft.kernels.activation import silu_and_mul, silu_mul  # noqa: E402
from blockdraft.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from blockdraft.kernels.rope import norm_rope, qk_norm_rope  # noqa: E402
from blockdraft.layers import fused_ops  # noqa: E402
from blockdraft.layers.fused_ops import set_fused_ops  # noqa: E402
from blockdraft.spec.dflash.checkpoint import random_drafter  # noqa: E402
from tests.layers.fused_cases import decode, random_target, ulp_distance  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


@pytest.fixture(autouse=True)
def bf16_rounding(monkeypatch):
    """fp32 -> bf16 casts in the interpreter round to nearest even, as compiled Triton does."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_ulp: int = 1, exact: bool = False) -> None:
    """Same dtype and shape; bit-identical if `exact`, else fp32 within float noise and 16-bit
    types within `max_ulp` ulps."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if exact:
        assert torch.equal(out, ref)
    elif out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert int(ulp_distance(out, ref).max()) <= max_ulp


def rand(*shape, dtype, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm(dtype):
    x = rand(2, 3, 40, dtype=dtype, scale=3)  # leading dims, N not a power of two
    w = rand(40, dtype=dtype, seed=1) * 0.5 + 1
    assert_matches(rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6))
    wide = rand(5, 64, dtype=dtype, seed=2)[:, 8:48]  # strided rows
    assert_matches(rms_norm(wide, w, 1e-5), fused_ops.rms_norm_ref(wide, w, 1e-5))


def test_rms_norm_promotes_to_an_fp32_weight():
    x, w = rand(3, 24, dtype=torch.bfloat16), rand(24, dtype=torch.float32, seed=1) + 1
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fused_ops.rms_norm_ref(x, w, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fused_add_rms_norm(dtype):
    x, r = rand(4, 48, dtype=dtype, seed=3), rand(4, 48, dtype=dtype, seed=4, scale=4)
    w = rand(48, dtype=dtype, seed=5) + 1
    x_before, r_before = x.clone(), r.clone()
    normed, residual = fused_add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_residual = fused_ops.add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(residual, ref_residual)  # one rounded add: bit-identical
    assert_matches(normed, ref_normed)
    assert torch.equal(x, x_before) and torch.equal(r, r_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24), (14, 2, 64)])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm_rope"])
def test_qk_norm_rope_on_qkv_views(dtype, heads, kv_heads, head_dim, with_norm):
    rows, q_size, kv_size = 5, heads * head_dim, kv_heads * head_dim
    qkv = rand(rows, q_size + 2 * kv_size, dtype=dtype, scale=2)
    q = qkv[:, :q_size].view(rows, heads, head_dim)  # row stride != heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(rows, kv_heads, head_dim)
    angles = torch.arange(rows)[:, None, None] * torch.rand(1, 1, head_dim // 2).repeat(1, 1, 2) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qw, kw = (rand(head_dim, dtype=dtype, seed=s) * 0.3 + 1 for s in (6, 7)) if with_norm else (None, None)
    qkv_before = qkv.clone()
    out_q, out_k = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    ref_q, ref_k = fused_ops.qk_norm_rope_ref(q, k, cos, sin, qw, kw, 1e-6)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    # RoPE alone: one rounded product or sum per torch op, the same in the kernel.
    assert_matches(out_q, ref_q, exact=not with_norm)
    assert_matches(out_k, ref_k, exact=not with_norm)
    assert torch.equal(qkv, qkv_before)
    assert_matches(norm_rope(k, cos, sin, kw, 1e-6), ref_k, exact=not with_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm_rope"])
def test_qk_norm_rope_writes_the_kv_cache_like_write_kv(dtype, with_norm):
    """kv_write: the cache afterwards holds exactly what write_kv(k_out, v) writes (padding slot
    -1 writes nothing, other slots untouched); q / k outputs are unchanged by the write."""
    from blockdraft.attention.torch_ref import write_kv

    rows, heads, kv_heads, head_dim, block = 4, 4, 2, 16, 4
    qkv = rand(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2, seed=21)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(rows, -1, head_dim) for t in (q, k, v))
    angles = torch.arange(rows)[:, None, None] * torch.rand(1, 1, head_dim // 2).repeat(1, 1, 2) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qw, kw = (rand(head_dim, dtype=dtype, seed=s) * 0.3 + 1 for s in (6, 7)) if with_norm else (None, None)
    slots = torch.tensor([9, -1, 2, 13])  # a padding row, slots across pages
    caches = [rand(5, block, kv_heads, head_dim, dtype=dtype, seed=s) for s in (22, 23)]
    expected = [c.clone() for c in caches]
    out_q, out_k = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, kv_write=(v, *caches, slots))
    plain_q, plain_k = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    assert torch.equal(out_q, plain_q) and torch.equal(out_k, plain_k)
    write_kv(*expected, plain_k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    # norm_rope (k alone, the drafter's context rows) writes the same
    k_caches = [rand(5, block, kv_heads, head_dim, dtype=dtype, seed=s) for s in (22, 23)]
    assert torch.equal(norm_rope(k, cos, sin, kw, 1e-6, kv_write=(v, *k_caches, slots)), plain_k)
    assert torch.equal(k_caches[0], expected[0]) and torch.equal(k_caches[1], expected[1])


def test_kv_write_refusals():
    k = rand(2, 2, 16, dtype=torch.float32)
    cos = sin = torch.ones(2, 16)
    cache = torch.zeros(3, 4, 2, 16)
    good = (rand(2, 2, 16, dtype=torch.float32), cache, cache.clone(), torch.tensor([0, 1]))
    for bad, match in [((rand(2, 3, 16, dtype=torch.float32),) + good[1:], "v must match k"),
                       (good[:1] + (torch.zeros(3, 4, 3, 16),) + good[2:], "k_cache must be"),
                       (good[:2] + (torch.zeros(2, 4, 2, 16),) + good[3:], "must match"),
                       (good[:3] + (torch.tensor([0.0, 1.0]),), "slot_mapping must be"),
                       (good[:3] + (torch.tensor([[0, 5], [1, 5]])[:, 0],), "contiguous int32")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            qk_norm_rope(k, k, cos, sin, kv_write=bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("inter", [40, 1100])  # one partial block; two blocks of 1024
def test_silu_and_mul(dtype, inter):
    gate_up = rand(3, 2 * inter, dtype=dtype, scale=3)
    assert_matches(silu_and_mul(gate_up), fused_ops.silu_and_mul_ref(gate_up))
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    assert_matches(silu_mul(gate, up), fused_ops.silu_mul_ref(gate, up))


def test_bad_inputs_are_refused():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x.double(), torch.ones(8), 1e-6)
    cos = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="both be None"):
        qk_norm_rope(x, x, cos, cos, torch.ones(8), None)
    with pytest.raises(ValueError, match="dtype"):
        qk_norm_rope(x, x.half(), cos, cos)
    with pytest.raises(ValueError, match="even"):
        qk_norm_rope(x[..., :7], x[..., :7], cos[..., :7], cos[..., :7])
    with pytest.raises(ValueError, match=r"\[rows, 2 \* I\]"):
        silu_and_mul(torch.ones(2, 5))


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Route CPU tensors of the model code through the (interpreted) kernels."""
    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_fused_path_matches_torch_path(kernels_on_cpu, arch, dtype):
    model = random_target(arch, dtype, seed=1)
    prompts = [[3, 4, 5, 6], [7, 8]]
    plain = decode(set_fused_ops(model, False), prompts, steps=2, aux_layer_ids=(0, 1))
    fused = decode(set_fused_ops(model, True), prompts, steps=2, aux_layer_ids=(0, 1))
    assert torch.equal(fused.tokens, plain.tokens)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused.logits, plain.logits, **tol)
    torch.testing.assert_close(fused.aux, plain.aux, **tol)


def test_drafter_fused_path_matches_torch_path(kernels_on_cpu):
    from blockdraft.attention.metadata import build_metadata
    from tests.spec._dflash_util import tiny_target_config

    drafter = random_drafter(tiny_target_config(), num_layers=2, block_size=4, init_std=0.1)
    feats, block = rand(3, drafter.config.num_aux_layers * 64, dtype=torch.float32), rand(4, 64, dtype=torch.float32)
    outs = []
    for enabled in (False, True):
        set_fused_ops(drafter, enabled)
        caches = drafter.allocate_kv_caches(2, 4)
        drafter.write_context(feats, torch.arange(3), caches, torch.arange(3))
        meta = build_metadata([3], [4], [[0]], 4, num_block_tokens=4)
        outs.append((drafter(block, torch.arange(3, 7), caches, meta), caches[0][0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
