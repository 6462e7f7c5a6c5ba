"""The sync-free dense twin equals the reference backend (torch_ref) on random ragged batches."""

from __future__ import annotations

import pytest
import torch

from blockdraft.attention.dense_ref import paged_attention_dense, row_requests_device, write_kv_dense
from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.attention.torch_ref import paged_attention
from tests.attention.paged_cases import random_case

TOL = dict(atol=1e-5, rtol=1e-5)


def check_against_ref(case) -> torch.Tensor:
    """Dense and reference outputs and caches agree; returns the dense output."""
    ref_caches = case.k_cache.clone(), case.v_cache.clone()
    expected = case.run(paged_attention, ref_caches)
    out = case.run(paged_attention_dense)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out, expected, **TOL)
    assert torch.equal(case.k_cache, ref_caches[0]) and torch.equal(case.v_cache, ref_caches[1])
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("window", [None, 1, 5, 17])
def test_causal_ragged_batches(seed, window):
    heads, kv_heads = [(4, 2), (6, 3), (4, 4), (8, 1)][seed % 4]
    case = random_case(seed, num_heads=heads, num_kv_heads=kv_heads, kv_block_size=[4, 8, 16][seed % 3],
                       sliding_window=window, num_pad_reqs=seed % 3, num_pad_rows=seed % 4)  # fmt: skip
    out = check_against_ref(case)
    assert torch.all(out[case.meta.query_start_loc_host[-1] :] == 0)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "causal,window", [(False, None), (True, None), (False, 3), (True, 6)], ids=["bidir", "causal", "slide3", "slide6"]
)
def test_draft_block_batches(seed, causal, window):
    case = random_case(seed, block_tokens=[1, 4, 16][seed % 3], sliding_window=window, causal=causal,
                       num_pad_reqs=seed % 3, num_pad_rows=seed % 3, kv_block_size=[4, 8][seed % 2])  # fmt: skip
    before = case.k_cache.clone(), case.v_cache.clone()
    check_against_ref(case)
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])  # nothing written


def test_missing_row_req_is_derived_from_query_start_loc():
    case = random_case(3, num_pad_reqs=2, num_pad_rows=3)
    expected = case.meta.row_req.clone()
    assert torch.equal(row_requests_device(case.meta.query_start_loc, case.q.shape[0]), expected)
    case.meta.row_req = None
    check_against_ref(case)


def test_reads_no_host_lists():
    case = random_case(5, num_pad_rows=1)
    expected = case.run(paged_attention, (case.k_cache.clone(), case.v_cache.clone()))
    case.meta.query_start_loc_host = case.meta.seq_lens_host = None
    torch.testing.assert_close(case.run(paged_attention_dense), expected, **TOL)


def test_bf16_matches_reference():
    case = random_case(7, dtype=torch.bfloat16, sliding_window=9)
    ref_caches = case.k_cache.clone(), case.v_cache.clone()
    expected = case.run(paged_attention, ref_caches)
    out = case.run(paged_attention_dense)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(case.k_cache, ref_caches[0])


def test_write_skips_padding_slots_wherever_they_are():
    cache = torch.zeros(3, 4, 2, 8)
    k = torch.randn(5, 2, 8)
    slots = torch.tensor([PADDING_SLOT, 7, PADDING_SLOT, 0, 11])
    write_kv_dense(cache, cache.clone(), k, k, slots)
    flat = cache.view(-1, 2, 8)
    for row, slot in ((1, 7), (3, 0), (4, 11)):
        assert torch.equal(flat[slot], k[row])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 3


def test_write_with_only_padding_slots_changes_nothing():
    cache = torch.randn(2, 4, 2, 8)
    before = cache.clone()
    write_kv_dense(cache, cache, torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.full((3,), PADDING_SLOT))
    assert torch.equal(cache, before)


def test_rejects_bad_gqa_shape():
    case = random_case(0, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_dense(case.q[:, :3], case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
