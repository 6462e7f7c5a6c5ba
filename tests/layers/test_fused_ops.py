"""Dispatch rules of blockdraft.layers.fused_ops and the residual-carrying layer path, on CPU.

No triton needed: CPU inputs must always run the torch twins, and the fused model path (residual
carried between layers, aux states rebuilt from it) must equal the plain path bit for bit when
its ops are the twins -- so the kernels are the only source of difference on CUDA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from blockdraft.layers import fused_ops
from blockdraft.layers.fused_ops import set_fused_ops, use_kernels
from blockdraft.layers.norm import RMSNorm
from blockdraft.spec.dflash.checkpoint import random_drafter
from tests.layers.fused_cases import decode, random_target


def _qk_norm_rope_twin(q, k, cos, sin, q_weight, k_weight, eps, kv_write=None):
    """The twin of kernels.rope.qk_norm_rope: with kv_write, the torch cache write follows."""
    from blockdraft.attention.torch_ref import write_kv

    q, k = fused_ops.qk_norm_rope_ref(q, k, cos, sin, q_weight, k_weight, eps)
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, k


def _norm_rope_twin(k, cos, sin, weight, eps, kv_write=None):
    """The twin of kernels.rope.norm_rope: with kv_write, the torch cache write follows."""
    from blockdraft.attention.torch_ref import write_kv

    k = fused_ops.norm_rope_ref(k, cos, sin, weight, eps)
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        write_kv(k_cache, v_cache, k, v, slot_mapping)
    return k


TWINS = SimpleNamespace(
    rms_norm=fused_ops.rms_norm_ref, fused_add_rms_norm=fused_ops.add_rms_norm_ref,
    qk_norm_rope=_qk_norm_rope_twin, norm_rope=_norm_rope_twin,
    silu_and_mul=fused_ops.silu_and_mul_ref, silu_mul=fused_ops.silu_mul_ref,
    # every shape "has" a skinny config, and its twin is F.linear (after silu(x) * up when gated)
    skinny_config_for=lambda rows, k, n, device: "twin", skinny_fuses_swiglu=lambda rows, k, n: True,
    skinny_linear=lambda x, w, b, config, up=None: F.linear(x if up is None else fused_ops.silu_mul_ref(x, up), w, b),
    # 2-16 rows: the gate/up matmul and the activation in one launch; twin = F.linear, then the activation
    skinny_swiglu_config_for=lambda rows, k, n, device: "twin" if 2 <= rows <= 16 else None,
    skinny_swiglu=lambda x, w, config: fused_ops.silu_and_mul_ref(F.linear(x, w)),
    argmax_rows=lambda x, out=None: torch.argmax(x, dim=-1) if out is None else torch.argmax(x, dim=-1, out=out),
)  # fmt: skip


@pytest.fixture
def kernel_path_with_twins(monkeypatch):
    """Route CPU tensors through the kernel branch, with the twins standing in for the kernels."""
    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    monkeypatch.setattr(fused_ops, "_kernels", lambda: TWINS)
    monkeypatch.setattr(fused_ops, "TRITON_AVAILABLE", True)


def test_cpu_inputs_never_reach_the_kernels(monkeypatch):
    def refuse():
        raise AssertionError("a CPU tensor took the kernel path")

    monkeypatch.setattr(fused_ops, "_kernels", refuse)
    model = random_target("qwen3")
    assert model.fused_ops == fused_ops.TRITON_AVAILABLE
    run = decode(model, [[1, 2, 3], [4, 5]], steps=2, aux_layer_ids=(0, 1))
    assert run.tokens.shape == (2, 3) and run.aux.shape[-1] == 2 * model.config.hidden_size


def test_use_kernels_rules(monkeypatch):
    x, w = torch.ones(2, 4), torch.ones(4, requires_grad=True)
    assert not use_kernels(True, x)  # CPU
    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    assert use_kernels(True, x, None) and not use_kernels(False, x)
    assert not use_kernels(True, x, w)  # autograd through the weight: kernels have no backward
    with torch.no_grad():
        assert use_kernels(True, x, w)


def test_mixed_dtypes_take_the_twin(monkeypatch):
    """Autocast evaluation (bf16 activations, fp32 weights and cos/sin) must not reach the
    one-dtype kernels."""

    def refuse():
        raise AssertionError("mixed dtypes took the kernel path")

    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    monkeypatch.setattr(fused_ops, "_kernels", refuse)
    k = torch.randn(3, 2, 8).bfloat16()
    cos, sin, w = torch.ones(3, 1, 8), torch.zeros(3, 1, 8), torch.ones(8)
    with torch.no_grad():
        out = fused_ops.norm_rope(k, cos, sin, w, 1e-6)
        q, _ = fused_ops.qk_norm_rope(k, k, cos, sin, w, w, 1e-6)
        fused_ops.fused_add_rms_norm(k, k.float(), w, 1e-6)
        fused_ops.silu_mul(k, k.float())
    assert out.dtype == q.dtype == torch.float32  # the twin's type promotion, as before


def test_set_fused_ops_switches_every_module(monkeypatch):
    model = random_target("qwen3")
    flagged = [m for m in model.modules() if isinstance(m, fused_ops.UsesFusedOps)]
    # CausalLM, and per layer: 2 norms + q/k norms, attention, MLP and its 4 linears (qkv, o,
    # gate_up, down: the skinny-GEMM kernels); plus the final norm and the untied LM head.
    lm_head = 0 if model.config.tie_word_embeddings else 1
    assert len(flagged) == 1 + model.config.num_hidden_layers * 10 + 1 + lm_head
    set_fused_ops(model, False)
    assert not any(m.fused_ops for m in flagged)
    monkeypatch.setattr(fused_ops, "TRITON_AVAILABLE", False)
    with pytest.raises(RuntimeError, match="triton"):
        set_fused_ops(model, True)


def test_rms_norm_residual_form():
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.normal_()
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    normed, residual = norm(x, r)
    assert torch.equal(residual, x + r) and torch.equal(normed, norm(x + r))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_carry_is_bit_identical(kernel_path_with_twins, arch, dtype):
    model = random_target(arch, dtype, seed=3)
    prompts, aux_ids = [[5, 6, 7, 8, 9], [10, 11]], (1, 0, 1)  # last layer, and a repeated id
    set_fused_ops(model, True)
    fused = decode(model, prompts, steps=3, aux_layer_ids=aux_ids)
    set_fused_ops(model, False)
    plain = decode(model, prompts, steps=3, aux_layer_ids=aux_ids)
    assert torch.equal(fused.logits, plain.logits)
    assert torch.equal(fused.aux, plain.aux)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drafter_residual_carry_is_bit_identical(kernel_path_with_twins, dtype):
    from blockdraft.attention.metadata import build_metadata
    from tests.spec._dflash_util import tiny_target_config

    drafter = random_drafter(tiny_target_config(), num_layers=2, block_size=4, init_std=0.1, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(7, drafter.config.num_aux_layers * 64, generator=gen)
    block = torch.randn(8, 64, generator=gen)
    outs = []
    for enabled in (True, False):
        set_fused_ops(drafter, enabled)
        caches = drafter.allocate_kv_caches(4, 4)
        drafter.write_context(feats, torch.arange(7), caches, torch.arange(7))
        meta = build_metadata([4, 3], [4, 4], [[0], [1]], 4, num_block_tokens=4)
        outs.append((drafter(block, torch.tensor([4, 5, 6, 7, 3, 4, 5, 6]), caches, meta), caches))
    (fused, fused_caches), (plain, plain_caches) = outs
    assert torch.equal(fused, plain)
    assert all(torch.equal(a, b) for fa, pa in zip(fused_caches, plain_caches) for a, b in zip(fa, pa))


def test_the_rope_kernel_writes_the_kv_cache_and_the_backend_only_attends(kernel_path_with_twins):
    """Causal layers on the kernel path write K/V in the RoPE launch and call the backend with
    kv_written=True; the twins leave the write to the backend; same logits either way (the
    decode reads every written slot back over 3 steps)."""
    model = random_target("qwen3", torch.bfloat16, seed=5)
    seen = []
    for layer in model.model.layers:
        real = layer.self_attn.backend

        def recording(*args, _real=real, **kwargs):
            seen.append(kwargs.get("kv_written", False))
            return _real(*args, **kwargs)

        recording.accepts_kv_written = True
        layer.self_attn.backend = recording
    set_fused_ops(model, True)
    fused = decode(model, [[5, 6, 7, 8, 9], [10, 11]], steps=3)
    assert seen and all(seen)
    seen.clear()
    set_fused_ops(model, False)
    plain = decode(model, [[5, 6, 7, 8, 9], [10, 11]], steps=3)
    assert seen and not any(seen)
    assert torch.equal(fused.logits, plain.logits)


def test_backends_without_the_flag_keep_writing(kernel_path_with_twins):
    model = random_target("llama", torch.bfloat16, seed=6)
    plain = decode(set_fused_ops(model, False), [[5, 6, 7]], steps=3)
    calls = []
    for layer in model.model.layers:
        real = layer.self_attn.backend
        layer.self_attn.backend = lambda *a, _real=real, **kw: calls.append(kw) or _real(*a, **kw)
    fused = decode(set_fused_ops(model, True), [[5, 6, 7]], steps=3)
    assert calls and all("kv_written" not in kw for kw in calls)
    assert torch.equal(fused.logits, plain.logits)  # the backend wrote what the decode reads back


def test_each_forward_writes_its_kv_once(kernel_path_with_twins, monkeypatch):
    """The RoPE launch's write replaces the backend's: as many cache writes per forward as layers."""
    from blockdraft.attention import torch_ref

    real, writes = torch_ref.write_kv, []
    monkeypatch.setattr(torch_ref, "write_kv", lambda *a: writes.append(1) or real(*a))
    model = random_target("qwen2", torch.bfloat16, seed=7)
    counts = []
    for enabled in (True, False):
        writes.clear()
        decode(set_fused_ops(model, enabled), [[5, 6, 7, 8], [9, 10]], steps=2)
        counts.append(len(writes))
    assert counts[0] == counts[1] == 3 * model.config.num_hidden_layers  # prefill + 2 steps


@pytest.mark.parametrize("k", [1, 3, 7])
def test_dflash_equals_plain_with_the_kv_write_in_the_rope_launch(kernel_path_with_twins, monkeypatch, k):
    """Engine level, every op on its kernel branch (twins standing in), so each causal layer
    writes K/V in the RoPE launch and the backend only attends: plain and DFlash decoding ==
    plain decoding on the torch ops (the backend writing), token for token, for batch sizes 1-4,
    seeded T > 0 and a stop token inside a draft block."""
    from blockdraft.layers import attention
    from blockdraft.sampling_params import SamplingParams
    from blockdraft.spec.dflash.speculator import DFlashSpeculator
    from tests.conftest import make_llm, random_prompts, tiny_target

    written = []
    real = attention.qk_norm_rope_write_kv
    monkeypatch.setattr(attention, "qk_norm_rope_write_kv", lambda *a: (lambda r: written.append(r[2]) or r)(real(*a)))
    target = tiny_target("qwen3", seed=k)
    prompts = random_prompts(4, seed=80 + k)
    greedy = make_llm(target).generate(prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, stop_token_ids=[greedy[5]]),
              SamplingParams(max_tokens=k + 1, ignore_eos=True)]  # fmt: skip
    set_fused_ops(target.model, False)  # the reference: torch ops, the backend writes K/V
    plain = [(o.token_ids, o.finish_reason) for o in make_llm(target).generate(prompts, params)]
    set_fused_ops(target.model, True)
    written.clear()
    assert [(o.token_ids, o.finish_reason) for o in make_llm(target).generate(prompts, params)] == plain
    drafter = random_drafter(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), seed=k, init_std=0.1)
    llm = make_llm(target, speculator=DFlashSpeculator(drafter, target.model, k, 256, 4))
    for bs in (1, 2, 4):
        assert [(o.token_ids, o.finish_reason) for o in llm.generate(prompts[:bs], params[:bs])] == plain[:bs]
    assert written and all(written) and llm.engine.stats.spec.num_drafted_tokens > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_logits_take_a_float32_argmax_with_the_same_ids(dtype, monkeypatch):
    """On the CPU, bf16 / fp16 logits are upcast before torch.argmax (faster there; exact, so the
    same ids, ties at the lowest id included)."""
    x = torch.randn(6, 3000, generator=torch.Generator().manual_seed(7)).to(dtype)
    x[2, 10] = x[2, 20] = x[2].max() + 1  # a tie: the lowest id wins
    x[3] = 0.5  # all equal: id 0
    want = torch.argmax(x, dim=-1)
    assert want[2] == 10 and want[3] == 0
    seen = []
    real = torch.argmax
    monkeypatch.setattr(torch, "argmax", lambda t, *a, **k: seen.append(t.dtype) or real(t, *a, **k))
    assert torch.equal(fused_ops.argmax(x, False), want)
    out = torch.empty(6, dtype=torch.int64)
    assert torch.equal(fused_ops.argmax(x, True, out=out), want) and torch.equal(out, want)
    assert seen == [torch.float32, torch.float32]
