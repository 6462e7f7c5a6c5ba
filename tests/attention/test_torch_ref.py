"""Reference paged attention against dense attention with hand-built masks (float64 oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from blockdraft.attention import torch_ref
from blockdraft.attention.metadata import PADDING_SLOT, build_metadata
from blockdraft.attention.torch_ref import paged_attention, write_kv

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 4
SCALE = DIM**-0.5


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [nq, H, D], k/v [nk, KVH, D], allowed [nq, nk] bool -> [nq, H, D] (float64 math)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def causal_allowed(q_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    k_pos = torch.arange(num_keys)[None, :]
    allowed = k_pos <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, None] - window
    return allowed


def shuffled_tables(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], int]:
    """Non-contiguous, shuffled page lists covering each length, and the page count."""
    need = [-(-n // BS) for n in lengths]
    pages = list(range(sum(need) + 3))  # spare pages stay untouched
    random.Random(seed).shuffle(pages)
    tables, at = [], 0
    for n in need:
        tables.append(pages[at : at + n])
        at += n
    return tables, len(pages)


def empty_cache(num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(num_pages, BS, KV_HEADS, DIM), torch.zeros(num_pages, BS, KV_HEADS, DIM)


def rand(rows: int, heads: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, heads, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["math", "sdpa"])
def path(request, monkeypatch):
    """Run every test on both attention paths (explicit math for small work, SDPA for large)."""
    if request.param == "sdpa":
        monkeypatch.setattr(torch_ref, "_MATH_MAX_SCORES", 0)
    return request.param


@pytest.mark.parametrize("window", [None, 3])
def test_ragged_prefill_across_page_boundaries_equals_dense(path, window):
    lengths = [1, 3, 4, 5, 9, 12]
    tables, num_pages = shuffled_tables(lengths)
    k_cache, v_cache = empty_cache(num_pages)
    rows = sum(lengths)
    q, k, v = rand(rows, HEADS, 1), rand(rows, KV_HEADS, 2), rand(rows, KV_HEADS, 3)
    meta = build_metadata(lengths, lengths, tables, BS)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, sliding_window=window)
    at = 0
    for n in lengths:
        sl = slice(at, at + n)
        expected = dense(q[sl], k[sl], v[sl], causal_allowed(torch.arange(n), n, window))
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=0)
        at += n


@pytest.mark.parametrize("window", [None, 3, 6])
def test_chunks_and_decode_rows_equal_one_shot(path, window):
    """One request fed as chunks 3, 1, 5 then single decode rows == dense over the full sequence."""
    total = 12
    tables, num_pages = shuffled_tables([total], seed=4)
    k_cache, v_cache = empty_cache(num_pages)
    q, k, v = rand(total, HEADS, 5), rand(total, KV_HEADS, 6), rand(total, KV_HEADS, 7)
    expected = dense(q, k, v, causal_allowed(torch.arange(total), total, window))
    done = 0
    for n in (3, 1, 5, 1, 1, 1):
        sl = slice(done, done + n)
        meta = build_metadata([done + n], [n], tables, BS)
        out = paged_attention(q[sl], k[sl], v[sl], k_cache, v_cache, meta, SCALE, sliding_window=window)
        torch.testing.assert_close(out, expected[sl], atol=1e-5, rtol=0)
        done += n


def test_padding_slot_rows_write_nothing_and_padding_rows_are_zero(path):
    tables, num_pages = shuffled_tables([6])
    k_cache, v_cache = empty_cache(num_pages)
    q, k, v = rand(8, HEADS, 8), rand(8, KV_HEADS, 9), rand(8, KV_HEADS, 10)
    meta = build_metadata([6], [6], tables, BS)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((2,), PADDING_SLOT)])  # 2 padding rows
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    assert torch.all(out[6:] == 0)
    flat = k_cache.view(-1, KV_HEADS, DIM)
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 6
    torch.testing.assert_close(flat[meta.slot_mapping[:6]], k[:6], atol=0, rtol=0)


def test_write_kv_skips_padding_slots():
    k_cache, v_cache = empty_cache(2)
    k, v = rand(3, KV_HEADS, 11), rand(3, KV_HEADS, 12)
    write_kv(k_cache, v_cache, k, v, torch.tensor([5, PADDING_SLOT, 0]))
    flat = v_cache.view(-1, KV_HEADS, DIM)
    assert torch.equal(flat[5], v[0]) and torch.equal(flat[0], v[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2


def _context(lengths: list[int], seed: int):
    """Caches holding `lengths` context tokens per request (shuffled pages) + the dense K/V."""
    tables, num_pages = shuffled_tables(lengths, seed)
    k_cache, v_cache = empty_cache(num_pages)
    ks, vs = [], []
    for i, n in enumerate(lengths):
        k, v = rand(n, KV_HEADS, 100 + i), rand(n, KV_HEADS, 200 + i)
        write_kv(k_cache, v_cache, k, v, build_metadata([n], [n], [tables[i]], BS).slot_mapping)
        ks.append(k)
        vs.append(v)
    return tables, k_cache, v_cache, ks, vs


def _block_allowed(ctx: int, block: int, causal: bool, window: int | None) -> torch.Tensor:
    q_pos = torch.arange(ctx, ctx + block)[:, None]
    k_pos = torch.arange(ctx + block)[None, :]
    allowed = (k_pos <= q_pos) if causal else torch.ones(block, ctx + block, dtype=torch.bool)
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


@pytest.mark.parametrize(
    "causal,window", [(False, None), (True, None), (False, 3)], ids=["bidirectional", "causal", "sliding"]
)
def test_draft_block_attends_context_plus_block_and_writes_nothing(path, causal, window):
    """Block rows see the cached context + their whole block (bidirectional unless causal or
    sliding, where the window forces causality); the block's K/V never enters the cache."""
    ctx_lens, block = [5, 9, 1], 4
    tables, k_cache, v_cache, ks, vs = _context(ctx_lens, seed=2)
    before = k_cache.clone(), v_cache.clone()
    rows = block * len(ctx_lens)
    q, k, v = rand(rows, HEADS, 20), rand(rows, KV_HEADS, 21), rand(rows, KV_HEADS, 22)
    meta = build_metadata(ctx_lens, [block] * 3, tables, BS, num_block_tokens=block)
    # Even real slots must not be written in draft-block mode.
    meta.slot_mapping = torch.arange(rows, dtype=torch.int64)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, sliding_window=window, causal=causal)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    for i, ctx in enumerate(ctx_lens):
        sl = slice(i * block, (i + 1) * block)
        keys, vals = torch.cat([ks[i], k[sl]]), torch.cat([vs[i], v[sl]])
        allowed = _block_allowed(ctx, block, causal or window is not None, window)
        torch.testing.assert_close(out[sl], dense(q[sl], keys, vals, allowed), atol=1e-5, rtol=0)


def test_bf16_cache_and_queries(path):
    tables, num_pages = shuffled_tables([7])
    k_cache = torch.zeros(num_pages, BS, KV_HEADS, DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = (rand(7, h, s).bfloat16() for h, s in ((HEADS, 30), (KV_HEADS, 31), (KV_HEADS, 32)))
    out = paged_attention(q, k, v, k_cache, v_cache, build_metadata([7], [7], tables, BS), SCALE)
    assert out.dtype == torch.bfloat16
    expected = dense(q.float(), k.float(), v.float(), causal_allowed(torch.arange(7), 7, None))
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)


def test_build_metadata_layout_and_errors():
    meta = build_metadata([6, 2], [2, 2], [[7, 3], [5]], BS)
    assert meta.query_start_loc_host == [0, 2, 4] and meta.seq_lens_host == [6, 2]
    assert meta.slot_mapping.tolist() == [3 * BS + 0, 3 * BS + 1, 5 * BS + 0, 5 * BS + 1]
    assert meta.block_table.tolist() == [[7, 3], [5, 0]]
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata([9], [1], [[0, 1]], BS)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        build_metadata([2], [3], [[0]], BS)
    with pytest.raises(ValueError, match="num_block_tokens"):
        build_metadata([2], [3], [[0]], BS, num_block_tokens=4)
