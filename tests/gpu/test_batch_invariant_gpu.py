"""--batch-invariant on the GPU: each row's bits do not depend on the batch around it (the GEMM,
attention, whole engines), so greedy DFlash == plain decoding token for token in bf16.
`python -m pytest -q tests/gpu`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.attention.metadata import build_metadata  # noqa: E402
from blockdraft.attention.triton_attention import paged_attention_triton  # noqa: E402
from blockdraft.kernels.invariant_gemm import invariant_linear  # noqa: E402
from blockdraft.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.gpu.runner_util import cached_real_target, cuda_llm, cuda_tiny_target, first_divergences  # noqa: E402

pytestmark = [pytest.mark.gpu]

# (in, out, bias) of Qwen2.5-0.5B's qkv / o / gate_up / down projections and LM head
LINEARS = [(896, 1152, True), (896, 896, False), (896, 9728, False), (4864, 896, False), (896, 151936, False)]


@pytest.mark.parametrize("k_in,n_out,bias", LINEARS)
def test_gemm_rows_are_the_same_bits_at_every_row_count(k_in, n_out, bias):
    g = torch.Generator("cuda").manual_seed(k_in + n_out)
    x = torch.randn(300, k_in, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n_out, k_in, device="cuda", generator=g) * 0.03).bfloat16()
    b = (torch.randn(n_out, device="cuda", generator=g) * 0.1).bfloat16() if bias else None
    full = invariant_linear(x, w, b)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), None if b is None else b.float()),
                               atol=3e-2, rtol=2e-2)  # fmt: skip
    for rows in (1, 2, 7, 16, 17, 64, 129):
        assert torch.equal(invariant_linear(x[:rows].contiguous(), w, b), full[:rows]), rows
    shifted = invariant_linear(x[5:21].contiguous(), w, b)  # rows at other positions in their tile
    assert torch.equal(shifted, full[5:21])
    fp32 = invariant_linear(x[:16].contiguous(), w, b, out_dtype=torch.float32)
    assert torch.equal(invariant_linear(x[3:4].contiguous(), w, b, out_dtype=torch.float32), fp32[3:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(14, 2, 64, None), (32, 8, 128, None), (14, 2, 64, 100)])
def test_attention_rows_are_the_same_bits_in_decode_verify_prefill_and_batches(dtype, heads, kv_heads, dim, window):
    """One request's last 16 rows: 16 one-row decode steps == one 16-row verify forward == the
    tail of one 316-row prefill == the verify forward beside another request's prefill chunk."""
    context, q_len, bs = 300, 16, 16
    g = torch.Generator("cuda").manual_seed(heads + dim)
    total = context + q_len
    q = torch.randn(total, heads, dim, device="cuda", generator=g).to(dtype)
    k = torch.randn(total, kv_heads, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(total, kv_heads, dim, device="cuda", generator=g).to(dtype)
    pages = list(range(total // bs + 1))
    other = list(range(len(pages), 2 * len(pages)))  # a second request's pages

    def fresh_cache():
        return (torch.zeros(2 * len(pages), bs, kv_heads, dim, device="cuda", dtype=dtype),
                torch.zeros(2 * len(pages), bs, kv_heads, dim, device="cuda", dtype=dtype))  # fmt: skip

    def attend(q_, k_, v_, cache, seq_lens, query_lens, tables):
        meta = build_metadata(seq_lens, query_lens, tables, bs, device="cuda")
        return paged_attention_triton(q_, k_, v_, *cache, meta, dim**-0.5, window, batch_invariant=True)

    cache = fresh_cache()
    prefill = attend(q, k, v, cache, [total], [total], [pages])[context:]
    cache = fresh_cache()
    attend(q[:context], k[:context], v[:context], cache, [context], [context], [pages])
    verify = attend(q[context:], k[context:], v[context:], cache, [total], [q_len], [pages])
    cache = fresh_cache()
    attend(q[:context], k[:context], v[:context], cache, [context], [context], [pages])
    decode = torch.cat([attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache, [i + 1], [1], [pages])
                        for i in range(context, total)])  # fmt: skip
    cache = fresh_cache()
    attend(q[:context], k[:context], v[:context], cache, [context], [context], [pages])
    mixed = attend(torch.cat([q[context:], q[:40]]), torch.cat([k[context:], k[:40]]), torch.cat([v[context:], v[:40]]),
                   cache, [total, 40], [q_len, 40], [pages, other])[:q_len]  # fmt: skip
    assert torch.equal(verify, decode)
    assert torch.equal(verify, prefill)
    assert torch.equal(verify, mixed)


def _tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("k", [5, 15])
def test_dflash_equals_plain_in_bf16_greedy_sampled_and_stopped_and_answers_do_not_depend_on_the_batch(k):
    """Greedy and seeded T = 0.8 requests side by side (the keyed sampler draws the same token from
    the same logits), then the same with a stop token that ends request 0 inside a draft block."""
    target = cuda_tiny_target(torch.bfloat16, seed=11)
    prompts = random_prompts(7, seed=12)
    params = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i in range(7)]  # fmt: skip
    plain_llm = cuda_llm(target, None, batch_invariant=True)
    alone = [_tokens(plain_llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    plain = _tokens(plain_llm, prompts, params)
    assert plain == alone, first_divergences(alone, plain)
    spec_llm = cuda_llm(target, k, batch_invariant=True)
    spec = _tokens(spec_llm, prompts, params)
    assert spec == plain, first_divergences(plain, spec)
    assert spec_llm.engine.stats.spec.num_drafted_tokens > 0
    stop_id = plain[0][20]
    stopped = [dataclasses.replace(sp, stop_token_ids=[stop_id]) for sp in params]
    plain_stopped = _tokens(plain_llm, prompts, stopped)
    assert len(plain_stopped[0]) <= 21 < len(plain[0])  # the stop fired (at its first occurrence)
    spec_stopped = _tokens(spec_llm, prompts, stopped)
    assert spec_stopped == plain_stopped, first_divergences(plain_stopped, spec_stopped)


@pytest.mark.parametrize("eager", [True, False], ids=["enforce-eager", "graphs"])
def test_batch_invariant_mode_routes_every_target_matmul_through_the_invariant_kernel(eager, monkeypatch):
    """Layers and LM head, in eager steps, graphs (their capture) and prompt log-probs; cuBLAS linear never."""
    from blockdraft.layers import fused_ops

    target = cuda_tiny_target(torch.bfloat16, seed=13)
    heads, invariant_logits = [], type(target.model)._invariant_logits

    def head_spy(self, *args, **kwargs):
        heads.append(1)
        return invariant_logits(self, *args, **kwargs)

    monkeypatch.setattr(type(target.model), "_invariant_logits", head_spy)
    used = {"invariant": 0, "other": 0}
    kernels = fused_ops._kernels()
    def counting(real, key):
        def call(*a, **kw):
            used[key] += 1
            return real(*a, **kw)

        return call

    for name, key in (("invariant_linear", "invariant"), ("skinny_linear", "other"), ("skinny_swiglu", "other")):
        monkeypatch.setattr(kernels, name, counting(getattr(kernels, name), key))
    monkeypatch.setattr(fused_ops.F, "linear", lambda *a, **kw: pytest.fail("cuBLAS linear in batch-invariant mode"))
    llm = cuda_llm(target, None, batch_invariant=True, enforce_eager=eager)  # graphs captured under the spies
    _tokens(llm, random_prompts(3, seed=14), SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=1))
    assert used["invariant"] > 0 and used["other"] == 0 and heads, (used, len(heads))


@pytest.mark.slow
def test_real_qwen_shipped_drafter_equals_plain_greedy_in_bf16():
    name = "qwen2.5-coder-0.5b-instruct"
    target = cached_real_target(name, "bfloat16")
    from tests.gpu.test_runner_real_gpu import QUESTIONS, _llm

    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=128)
    plain_llm = _llm(target, name, False, batch_invariant=True)
    plain = _tokens(plain_llm, chats, params)
    alone = [_tokens(plain_llm, [c], params)[0] for c in chats]
    assert plain == alone, first_divergences(alone, plain)
    spec_llm = _llm(target, name, True, batch_invariant=True)
    spec = _tokens(spec_llm, chats, params)
    assert spec == plain, first_divergences(plain, spec)
    stats = spec_llm.engine.stats.spec
    assert stats.num_accepted_tokens > 0
