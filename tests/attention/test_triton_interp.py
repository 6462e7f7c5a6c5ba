"""Triton paged attention == its torch twin (dense_ref, itself checked against torch_ref), run on
CPU through Triton's interpreter. Tiny shapes: the interpreter is slow. bf16 is covered by the
GPU suite only (the 3.6 interpreter multiplies bf16 tl.dot operands as raw bits).
"""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.attention.triton_attention")

import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft.attention.dense_ref import paged_attention_dense  # noqa: E402
from blockdraft.attention.metadata import PADDING_SLOT  # noqa: E402
from blockdraft.attention.triton_attention import paged_attention_triton, write_kv_triton  # noqa: E402
from tests.attention.paged_cases import random_case  # noqa: E402
from tests.triton_interp import numpy_index_shim  # noqa: E402,F401  (autouse fixture)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def check(seed: int, **kwargs) -> None:
    """Kernel and twin agree on the output (padding rows exactly zero) and on the caches."""
    case, twin = random_case(seed, **kwargs), random_case(seed, **kwargs)
    out = case.run(paged_attention_triton)
    expected = twin.run(paged_attention_dense)
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out, expected, **TOL[case.q.dtype])
    assert torch.all(out[case.meta.row_req < 0] == 0)
    assert torch.equal(case.k_cache, twin.k_cache) and torch.equal(case.v_cache, twin.v_cache)


@pytest.mark.parametrize(
    "seed,heads,kv_heads,bs,window",
    [(0, 4, 2, 8, None), (1, 4, 2, 4, 5), (2, 3, 3, 16, None), (3, 8, 1, 8, 1), (4, 4, 2, 8, 70)],
)
def test_causal_batches(seed, heads, kv_heads, bs, window):
    check(seed, num_heads=heads, num_kv_heads=kv_heads, kv_block_size=bs, sliding_window=window,
          num_reqs=3, num_pad_reqs=seed % 2 + 1, max_ctx=70)  # fmt: skip


@pytest.mark.parametrize(
    "seed,block,causal,window",
    [(10, 4, False, None), (11, 4, True, None), (12, 5, False, 3), (13, 16, False, None), (14, 2, True, 9)],
)
def test_draft_blocks(seed, block, causal, window):
    check(seed, block_tokens=block, causal=causal, sliding_window=window, num_reqs=2, num_pad_reqs=1, max_ctx=70)


def test_fp16():
    check(20, dtype=torch.float16, num_reqs=3, sliding_window=7)


def test_missing_row_req_and_host_lists():
    case, twin = random_case(21, num_reqs=3), random_case(21, num_reqs=3)
    case.meta.row_req = None
    case.meta.query_start_loc_host = case.meta.seq_lens_host = None
    torch.testing.assert_close(case.run(paged_attention_triton), twin.run(paged_attention_dense), **TOL[torch.float32])


def test_strided_qkv_views_are_read_in_place():
    """q/k/v as splits of one fused projection (non-contiguous rows), like Attention.project_qkv."""
    case, twin = random_case(22, num_reqs=2), random_case(22, num_reqs=2)
    fused = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
    q, k, v = fused.split([case.q[0].numel(), case.k[0].numel(), case.v[0].numel()], dim=1)
    case.q, case.k, case.v = q.view(case.q.shape), k.view(case.k.shape), v.view(case.v.shape)
    assert not case.k.is_contiguous()
    torch.testing.assert_close(case.run(paged_attention_triton), twin.run(paged_attention_dense), **TOL[torch.float32])
    assert torch.equal(case.k_cache, twin.k_cache)


def test_write_kv_skips_padding_slots():
    cache = torch.zeros(3, 4, 2, 16)
    v_cache = torch.zeros_like(cache)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    write_kv_triton(cache, v_cache, k, v, torch.tensor([PADDING_SLOT, 7, PADDING_SLOT, 0, 11]))
    flat, vflat = cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    for row, slot in ((1, 7), (3, 0), (4, 11)):
        assert torch.equal(flat[slot], k[row]) and torch.equal(vflat[slot], v[row])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 3


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(head_dim=24), "power of two"),
        (dict(dtype=torch.float64), "cache dtype"),
        (dict(num_heads=3, num_kv_heads=2), "multiple of num_kv_heads"),
    ],
)
def test_refuses_unsupported_shapes(change, match):
    case = random_case(23, num_reqs=1, **change)
    with pytest.raises(ValueError, match=match):
        case.run(paged_attention_triton)


def test_refuses_mixed_dtypes_and_bad_window():
    case = random_case(24, num_reqs=1)
    case.q = case.q.half()
    with pytest.raises(ValueError, match="share one dtype"):
        case.run(paged_attention_triton)
    case = random_case(24, num_reqs=1, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window"):
        case.run(paged_attention_triton)
