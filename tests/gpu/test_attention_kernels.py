"""Compiled Triton paged attention (and the dense twin) on CUDA against torch_ref: real model
shapes, bf16 / fp16 / fp32, random ragged batches, poisoned memory, no host syncs, CUDA graphs.

Run on a GPU machine: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.attention.dense_ref import paged_attention_dense  # noqa: E402
from blockdraft.attention.torch_ref import paged_attention  # noqa: E402
from blockdraft.attention.triton_attention import (  # noqa: E402
    kv_splits_for,
    multi_row_kv_splits,
    paged_attention_triton,
    use_multi_row,
    write_kv_triton,
)
from blockdraft.bench.attention_kernels import make_batch  # noqa: E402
from tests.attention.paged_cases import PagedCase, pad_to, random_case  # noqa: E402
from tests.gpu.cuda_util import capture, no_host_sync, poison_allocator  # noqa: E402

pytestmark = [pytest.mark.gpu]

# (num_heads, num_kv_heads, head_dim) of the targets, and of the DFlash drafters that share them.
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
TOL = {
    torch.float32: dict(atol=5e-5, rtol=5e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DRAFT_BLOCK = 16
# Both attention kernels, whatever the shape heuristic would pick (see use_multi_row).
SINGLE_ROW = functools.partial(paged_attention_triton, multi_row=False)
MULTI_ROW = functools.partial(paged_attention_triton, multi_row=True)
MULTI_ROW_16 = functools.partial(paged_attention_triton, multi_row=True, block_m=16)  # many small tiles


def reference(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_ref in float32 on the case's exact values -> (output, k_cache, v_cache) in its dtype.
    Large requests take torch_ref's SDPA path: pin it to the exact float32 math backend."""
    f32 = PagedCase(*(x.float() for x in (case.q, case.k, case.v, case.k_cache, case.v_cache)),
                    case.meta, case.scale, case.sliding_window, case.causal)  # fmt: skip
    with sdpa_kernel(SDPBackend.MATH):
        out = f32.run(paged_attention)
    dtype = case.q.dtype
    return out, f32.k_cache.to(dtype), f32.v_cache.to(dtype)


def check(case: PagedCase, backend=paged_attention_triton) -> None:
    """`backend` equals torch_ref (output, padding rows exactly zero, caches bit-exact)."""
    expected, k_ref, v_ref = reference(case)
    poison_allocator()
    out = case.run(backend)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, **TOL[case.q.dtype])
    assert torch.all(out[case.meta.row_req < 0] == 0)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("window", [None, 200], ids=["full", "window200"])
def test_causal_batches_real_shapes(model, dtype, window):
    heads, kv_heads, dim = SHAPES[model]
    for seed in range(8):
        case = random_case(seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, kv_block_size=16,
                           num_reqs=1 + seed * 2, max_ctx=[64, 700, 2500][seed % 3], max_chunk=[24, 300][seed % 2],
                           sliding_window=window, num_pad_reqs=seed % 3, num_pad_rows=seed % 5, dtype=dtype,
                           device="cuda")  # fmt: skip
        check(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize(
    "causal,window", [(False, None), (True, None), (False, 48)], ids=["bidirectional", "causal", "sliding48"]
)
def test_draft_block_real_shapes(model, dtype, causal, window):
    heads, kv_heads, dim = SHAPES[model]
    for seed in range(6):
        case = random_case(100 + seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, kv_block_size=16,
                           num_reqs=1 + seed * 6, max_ctx=[40, 1000, 3000][seed % 3], block_tokens=DRAFT_BLOCK,
                           causal=causal, sliding_window=window, num_pad_reqs=seed % 2, num_pad_rows=seed % 3,
                           dtype=dtype, device="cuda")  # fmt: skip
        before = case.k_cache.clone()
        check(case)
        assert torch.equal(case.k_cache, before)


@pytest.mark.parametrize("bs", [1, 8, 32, 48])
def test_page_sizes_and_fp16(bs):
    for seed in range(4):
        check(random_case(200 + seed, num_heads=14, num_kv_heads=2, head_dim=64, kv_block_size=bs, num_reqs=6,
                          max_ctx=300, sliding_window=[None, 33][seed % 2], dtype=torch.float16,
                          device="cuda"))  # fmt: skip


def test_long_decode_and_long_prefill_chunk():
    heads, kv_heads, dim = SHAPES["qwen3-8b"]
    for seed, kinds, ctx, chunk in ((300, ("decode",), 8192, 1), (301, ("prefill",), 4096, 2048)):
        check(random_case(seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, num_reqs=4, max_ctx=ctx,
                          max_chunk=chunk, kinds=kinds, dtype=torch.bfloat16, device="cuda"))  # fmt: skip


@pytest.mark.parametrize("multi_row", [False, True], ids=["single_row", "multi_row"])
@pytest.mark.parametrize("splits", [1, 3, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_forced_kv_splits(splits, dtype, multi_row):
    """The split-KV path (and the single launch) of both kernels for decode, verify and
    draft-block batches, whatever the heuristic would pick."""
    backend = functools.partial(paged_attention_triton, num_kv_splits=splits, multi_row=multi_row)
    for seed, (model, kinds, block, window) in enumerate([
        ("qwen2.5-0.5b", ("decode",), 0, None), ("qwen3-8b", ("verify",), 0, 300),
        ("smollm2-135m", ("prefill",), 0, None), ("qwen3-8b", (), DRAFT_BLOCK, None),
        ("qwen2.5-0.5b", (), DRAFT_BLOCK, 40),
    ]):  # fmt: skip
        heads, kv_heads, dim = SHAPES[model]
        case = random_case(700 + seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, num_reqs=4,
                           max_ctx=4000, max_chunk=64, kinds=kinds or ("decode",), block_tokens=block,
                           causal=False, sliding_window=window, dtype=dtype, device="cuda")  # fmt: skip
        check(case, backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize(
    "scenario,causal,window",
    [("verify", True, None), ("verify", True, 200), ("draft", False, None), ("draft", True, None),
     ("draft", True, 48)],
    ids=["verify", "verify_window200", "draft_bidirectional", "draft_causal", "draft_sliding48"],
)  # fmt: skip
@pytest.mark.parametrize("backend", [MULTI_ROW, MULTI_ROW_16, SINGLE_ROW], ids=["multi", "multi16", "single"])
def test_verify_and_draft_shapes_match_twin(model, dtype, scenario, causal, window, backend):
    """The benchmark's verify (16 causal rows per request) and draft-block (16 uncached rows)
    batches: each kernel equals the dense twin on the same inputs (and on the cache writes)."""
    heads, kv_heads, dim = SHAPES[model]
    for batch, ctx in ((1, 37), (8, 1024), (3, 3000)):
        tensors, meta = make_batch(scenario, batch, ctx, (heads, kv_heads, dim), dtype, "cuda", seed=batch)
        meta.query_start_loc_host = meta.seq_lens_host = None
        if scenario == "draft":  # make_batch's draft scenario is bidirectional; vary it here
            case = PagedCase(*tensors, meta, dim**-0.5, window, causal)
        else:
            case = PagedCase(*tensors, meta, dim**-0.5, window, True)
        twin = PagedCase(*(x.clone() for x in tensors), meta, case.scale, case.sliding_window, case.causal)
        expected = twin.run(paged_attention_dense)
        poison_allocator()
        out = case.run(backend)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])
        assert torch.equal(case.k_cache, twin.k_cache) and torch.equal(case.v_cache, twin.v_cache)


def test_multi_row_heuristic_on_bench_shapes():
    """Verify and draft batches take the multi-row kernel, decode batches the single-row one."""
    for scenario, expected in (("decode", False), ("verify", True), ("draft", True)):
        (q, *_), meta = make_batch(scenario, 32, 64, SHAPES["qwen3-8b"], torch.bfloat16, "cuda")
        assert use_multi_row(q.shape[0], meta.num_reqs, meta.num_block_tokens, group=4) is expected
        assert use_multi_row(q.shape[0], meta.num_reqs, meta.num_block_tokens, group=7) is expected


def test_split_heuristic_fills_small_batches_only():
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert kv_splits_for(1, 2, device) > 1
    assert kv_splits_for(sms, 1, device) == 1
    assert multi_row_kv_splits(1, 2, device) > 1
    assert multi_row_kv_splits(-(-sms // 2), 1, device) == 1  # half the SMs busy: no merge launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_twin_on_cuda(dtype):
    for seed, block in ((400, 0), (401, DRAFT_BLOCK), (402, 0)):
        case = random_case(seed, num_heads=14, num_kv_heads=2, head_dim=64, num_reqs=5, max_ctx=300,
                           block_tokens=block, sliding_window=[None, 40][seed % 2], dtype=dtype,
                           device="cuda")  # fmt: skip
        check(case, paged_attention_dense)


@pytest.mark.parametrize(
    "backend",
    [paged_attention_triton, functools.partial(paged_attention_triton, num_kv_splits=4), SINGLE_ROW, MULTI_ROW,
     functools.partial(paged_attention_triton, num_kv_splits=4, multi_row=True), paged_attention_dense],
    ids=["triton", "triton_split4", "single_row", "multi_row", "multi_row_split4", "dense"],
)  # fmt: skip
@pytest.mark.parametrize("block", [0, DRAFT_BLOCK], ids=["causal", "draft_block"])
def test_no_host_sync(backend, block):
    case = random_case(500, num_heads=14, num_kv_heads=2, head_dim=64, block_tokens=block, sliding_window=64,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    case.meta.query_start_loc_host = case.meta.seq_lens_host = None
    case.run(backend)  # compile outside the checked region
    with no_host_sync():
        case.run(backend)
        write_kv_triton(case.k_cache, case.v_cache, case.k, case.v, case.meta.slot_mapping)


@pytest.mark.parametrize(
    "backend",
    [paged_attention_triton, SINGLE_ROW, MULTI_ROW_16, paged_attention_dense],
    ids=["triton", "triton_single_row", "triton_multi_row16", "dense"],
)
@pytest.mark.parametrize(
    "block,causal,window", [(0, True, None), (0, True, 100), (DRAFT_BLOCK, False, None), (DRAFT_BLOCK, True, 40)]
)
@pytest.mark.parametrize("bucket_rows", [160, 40], ids=["rows160", "rows40_split"])
def test_cuda_graph_replay_with_new_batches(backend, block, causal, window, bucket_rows):
    """Capture once on a padded bucket, then replay with different batches copied into the static
    tensors: outputs and cache writes follow the new contents. The 40-row bucket leaves the GPU
    idle, so the Triton backend captures its split-KV path. Both buckets average >= 2 rows per
    request, so plain "triton" captures the multi-row kernel (its own tile); the forced variants
    capture the single-row kernel and multi-row tiles of 16 (requests over several tiles)."""
    heads, kv_heads, dim = SHAPES["qwen2.5-0.5b"]
    bucket = dict(num_rows=bucket_rows, num_reqs=10, width=40, num_pages=400)
    max_reqs = 6 if bucket_rows == 160 else 2

    def make(seed: int) -> PagedCase:
        case = random_case(seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, kv_block_size=16,
                           num_reqs=1 + seed % max_reqs,
                           max_ctx=500, max_chunk=12, block_tokens=block, causal=causal, sliding_window=window,
                           dtype=torch.bfloat16, device="cuda")  # fmt: skip
        return pad_to(case, **bucket, seed=seed)

    static = make(600)
    graph, out = capture(lambda: static.run(backend))
    for seed in (601, 602, 603):
        case = make(seed)
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            getattr(static, name).copy_(getattr(case, name))
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "row_req"):
            getattr(static.meta, name).copy_(getattr(case.meta, name))
        graph.replay()
        expected, k_ref, v_ref = reference(case)
        torch.testing.assert_close(out.float(), expected, **TOL[torch.bfloat16])
        assert torch.all(out[case.meta.row_req < 0] == 0)
        assert torch.equal(static.k_cache, k_ref) and torch.equal(static.v_cache, v_ref)
