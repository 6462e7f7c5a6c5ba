"""Triton paged attention == its torch twin (dense_ref, itself checked against torch_ref), run on
CPU through Triton's interpreter. Tiny shapes: the interpreter is slow. bf16 is covered by the
GPU suite only (the 3.6 interpreter multiplies bf16 tl.dot operands as raw bits).

Both attention kernels are checked on every case: the single-row one (`multi_row=False`) and the
multi-row one (`multi_row=True`), the latter also with small forced tiles (`block_m`) so that
requests span several query tiles and tiles hold odd row counts. Outputs are allocated poisoned
(NaN) so a row or partial that no program writes shows up.
"""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.attention.triton_attention")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft.attention.dense_ref import paged_attention_dense  # noqa: E402
from blockdraft.attention.metadata import PADDING_SLOT  # noqa: E402
from blockdraft.attention.triton_attention import (  # noqa: E402
    multi_row_block_m,
    paged_attention_triton,
    use_multi_row,
    write_kv_triton,
)
from tests.attention.paged_cases import random_case  # noqa: E402
from tests.triton_interp import numpy_index_shim  # noqa: E402,F401  (autouse fixture)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# (multi_row, block_m): the single-row kernel, the multi-row one with its own tile, and with a
# 16-wide tile (GQA group 2 -> 8 rows per tile, group 3 -> 5, group 8 -> 2).
PATHS = {"single": (False, None), "multi": (True, None), "multi16": (True, 16)}


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty returns NaN-filled float tensors, so unwritten outputs / partials show."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


def check(seed: int, splits: int = 1, path: str = "single", **kwargs) -> None:
    """Kernel (`path` of PATHS, with `splits` KV splits) and twin agree on the output (padding
    rows exactly zero) and on the caches."""
    case, twin = random_case(seed, **kwargs), random_case(seed, **kwargs)
    multi_row, block_m = PATHS[path]
    out = case.run(functools.partial(paged_attention_triton, num_kv_splits=splits, multi_row=multi_row,
                                     block_m=block_m))  # fmt: skip
    expected = twin.run(paged_attention_dense)
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out, expected, **TOL[case.q.dtype])
    assert torch.all(out[case.meta.row_req < 0] == 0)
    assert torch.equal(case.k_cache, twin.k_cache) and torch.equal(case.v_cache, twin.v_cache)


@pytest.mark.parametrize(
    "seed,heads,kv_heads,bs,window,splits",
    [(0, 4, 2, 8, None, 1), (1, 4, 2, 4, 5, 1), (2, 3, 3, 16, None, 1), (3, 8, 1, 8, 1, 1), (4, 4, 2, 8, 70, 1),
     (5, 4, 2, 8, None, 3), (6, 4, 2, 16, 40, 4), (7, 6, 3, 4, 2, 2)],
)  # fmt: skip
@pytest.mark.parametrize("path", PATHS)
def test_causal_batches(seed, heads, kv_heads, bs, window, splits, path):
    check(seed, splits, path, num_heads=heads, num_kv_heads=kv_heads, kv_block_size=bs, sliding_window=window,
          num_reqs=3, num_pad_reqs=seed % 2 + 1, max_ctx=[70, 150][splits > 1])  # fmt: skip


@pytest.mark.parametrize(
    "seed,block,causal,window,splits",
    [(10, 4, False, None, 1), (11, 4, True, None, 1), (12, 5, False, 3, 1), (13, 16, False, None, 1),
     (14, 2, True, 9, 1), (15, 4, False, None, 3), (16, 4, True, 70, 2)],
)  # fmt: skip
@pytest.mark.parametrize("path", PATHS)
def test_draft_blocks(seed, block, causal, window, splits, path):
    check(seed, splits, path, block_tokens=block, causal=causal, sliding_window=window, num_reqs=2, num_pad_reqs=1,
          max_ctx=[70, 150][splits > 1])  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_fp16(path):
    check(20, path=path, dtype=torch.float16, num_reqs=3, sliding_window=7)


@pytest.mark.parametrize(
    "seed,heads,kv_heads,dim,bs,kinds,block,window,block_m,splits",
    [
        # GQA groups 1 / 2 / 4 / 7, head dims 64 / 128, page sizes 1..16, mixed decode+verify+prefill.
        (30, 4, 4, 16, 8, ("decode", "verify", "prefill"), 0, None, 16, 1),
        (31, 8, 2, 64, 4, ("verify",), 0, None, None, 1),
        (32, 8, 2, 128, 16, ("verify", "prefill"), 0, 9, 16, 1),
        (33, 14, 2, 64, 8, ("decode", "prefill"), 0, None, 16, 2),
        (34, 14, 2, 16, 1, ("verify", "prefill"), 0, 4, 32, 1),
        (35, 4, 2, 16, 16, ("prefill",), 0, None, 16, 1),  # chunks of up to 40 rows: 5+ tiles
        (36, 6, 2, 16, 3, ("decode",), 0, 2, 16, 1),  # decode rows forced onto multi-row tiles
        # Draft blocks: bidirectional / causal / causal + window, blocks wider than one tile.
        (40, 8, 2, 64, 8, (), 16, None, None, 1),
        (41, 8, 2, 16, 4, (), 16, None, 16, 1),  # 16 block rows over two 8-row tiles
        (42, 14, 2, 16, 8, (), 5, 3, 16, 2),  # group 7: 2 rows per tile, odd block
        (43, 4, 1, 128, 16, (), 7, None, 16, 1),  # group 4: 4 rows per tile, odd block
    ],
)  # fmt: skip
def test_multi_row_shapes(seed, heads, kv_heads, dim, bs, kinds, block, window, block_m, splits):
    """The multi-row kernel on GQA groups, head dims, page sizes and tiles the PATHS cases miss
    (draft blocks: causal for even seeds, bidirectional for odd ones)."""
    case_kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, kv_block_size=bs, num_reqs=3,
                       kinds=kinds or ("decode",), block_tokens=block, causal=seed % 2 == 0, sliding_window=window,
                       max_ctx=60, max_chunk=40, num_pad_reqs=seed % 2 + 1, num_pad_rows=seed % 3 + 1)  # fmt: skip
    case, twin = random_case(seed, **case_kwargs), random_case(seed, **case_kwargs)
    backend = functools.partial(paged_attention_triton, multi_row=True, block_m=block_m, num_kv_splits=splits)
    out = case.run(backend)
    torch.testing.assert_close(out, twin.run(paged_attention_dense), **TOL[torch.float32])
    assert torch.all(out[case.meta.row_req < 0] == 0)
    assert torch.equal(case.k_cache, twin.k_cache) and torch.equal(case.v_cache, twin.v_cache)


@pytest.mark.parametrize("path", ["multi", "multi16"])
@pytest.mark.parametrize("block", [0, 4])
def test_multi_row_only_padding(path, block):
    """A bucket with no real request (padding requests, padding rows): zeros, nothing written."""
    case = random_case(25, num_reqs=0, num_pad_reqs=2, num_pad_rows=5, block_tokens=block)
    before = case.k_cache.clone()
    multi_row, block_m = PATHS[path]
    out = case.run(functools.partial(paged_attention_triton, multi_row=multi_row, block_m=block_m))
    assert out.shape[0] == 5 and torch.all(out == 0)
    assert torch.equal(case.k_cache, before)


def test_multi_row_padding_row_req_is_inert():
    """A row whose row_req is -1 gives zeros on the multi-row path too (as in the twin)."""
    case, twin = random_case(26, num_reqs=3, kinds=("verify",)), random_case(26, num_reqs=3, kinds=("verify",))
    for c in (case, twin):
        c.meta.row_req[1] = -1
    out = case.run(functools.partial(paged_attention_triton, multi_row=True, block_m=16))
    torch.testing.assert_close(out, twin.run(paged_attention_dense), **TOL[torch.float32])
    assert torch.all(out[1] == 0)


def test_path_choice_from_shapes():
    """Decode batches keep the single-row kernel; verify / draft / prefill batches go multi-row
    (one request of a large GQA group stays single-row); the tile holds a whole 16-row request
    where it fits in M 64."""
    assert not use_multi_row(num_rows=32, num_reqs=32, num_block_tokens=0)
    assert use_multi_row(num_rows=512, num_reqs=32, num_block_tokens=0)
    assert use_multi_row(num_rows=16, num_reqs=1, num_block_tokens=16)
    assert use_multi_row(num_rows=512, num_reqs=32, num_block_tokens=0, group=4)
    assert use_multi_row(num_rows=512, num_reqs=32, num_block_tokens=16, group=7)  # measured 2x faster
    assert not use_multi_row(num_rows=16, num_reqs=1, num_block_tokens=16, group=7)  # one request: a tie
    assert multi_row_block_m(512, 32, group=4, head_dim=128) == 64  # Qwen3-8B verify: 16 rows x 4
    assert multi_row_block_m(512, 32, group=7, head_dim=64) == 64  # 9 rows of group 7 (M 128 slower)
    assert multi_row_block_m(4096, 2, group=7, head_dim=64) == 128  # prefill keeps the large tile
    assert multi_row_block_m(4096, 2, group=4, head_dim=128) == 128  # prefill: 32-row tiles
    assert multi_row_block_m(4096, 2, group=4, head_dim=256) == 64
    assert multi_row_block_m(4096, 2, group=4, head_dim=128, elem_bytes=4) == 64  # float32 tiles
    assert multi_row_block_m(32, 16, group=1, head_dim=128, num_block_tokens=16) == 16


@pytest.mark.parametrize("path", PATHS)
def test_missing_row_req_and_host_lists(path):
    case, twin = random_case(21, num_reqs=3), random_case(21, num_reqs=3)
    case.meta.row_req = None
    case.meta.query_start_loc_host = case.meta.seq_lens_host = None
    multi_row, block_m = PATHS[path]
    out = case.run(functools.partial(paged_attention_triton, multi_row=multi_row, block_m=block_m))
    torch.testing.assert_close(out, twin.run(paged_attention_dense), **TOL[torch.float32])


def test_strided_qkv_views_are_read_in_place():
    """q/k/v as splits of one fused projection (non-contiguous rows), like Attention.project_qkv."""
    case, twin = random_case(22, num_reqs=2), random_case(22, num_reqs=2)
    fused = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
    q, k, v = fused.split([case.q[0].numel(), case.k[0].numel(), case.v[0].numel()], dim=1)
    case.q, case.k, case.v = q.view(case.q.shape), k.view(case.k.shape), v.view(case.v.shape)
    assert not case.k.is_contiguous()
    torch.testing.assert_close(case.run(paged_attention_triton), twin.run(paged_attention_dense), **TOL[torch.float32])
    assert torch.equal(case.k_cache, twin.k_cache)


@pytest.mark.parametrize("path", PATHS)
def test_strided_metadata_views_are_read_as_their_values(path):
    """query_start_loc / seq_lens / row_req as strided views whose storage holds junk between the
    elements (a stride-0 row_req once read stale rows past a one-request draft block: an illegal
    address on the H200, session 24): the kernels see the views' values."""
    case, twin = random_case(27, num_reqs=2, block_tokens=4), random_case(27, num_reqs=2, block_tokens=4)

    def strided(x: torch.Tensor, junk: int) -> torch.Tensor:
        spread = torch.full((x.numel(), 2), junk, dtype=x.dtype)
        spread[:, 0] = x
        return spread[:, 0]  # stride 2

    m = case.meta
    m.query_start_loc, m.seq_lens = strided(m.query_start_loc, 1), strided(m.seq_lens, 1)  # in range, wrong
    m.row_req = strided(m.row_req, 1)
    assert m.row_req.stride(0) == 2
    multi_row, block_m = PATHS[path]
    out = case.run(functools.partial(paged_attention_triton, multi_row=multi_row, block_m=block_m))
    torch.testing.assert_close(out, twin.run(paged_attention_dense), **TOL[torch.float32])


def test_write_kv_skips_padding_slots():
    cache = torch.zeros(3, 4, 2, 16)
    v_cache = torch.zeros_like(cache)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    write_kv_triton(cache, v_cache, k, v, torch.tensor([PADDING_SLOT, 7, PADDING_SLOT, 0, 11]))
    flat, vflat = cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    for row, slot in ((1, 7), (3, 0), (4, 11)):
        assert torch.equal(flat[slot], k[row]) and torch.equal(vflat[slot], v[row])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 3
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):  # would be read as [7, 3, ...]
        write_kv_triton(cache, v_cache, k, v, torch.tensor([[7, 3], [0, 3], [1, 3], [2, 3], [4, 3]])[:, 0])


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


def test_refuses_mixed_dtypes_bad_window_and_bad_splits():
    case = random_case(24, num_reqs=1)
    case.q = case.q.half()
    with pytest.raises(ValueError, match="share one dtype"):
        case.run(paged_attention_triton)
    case = random_case(24, num_reqs=1, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window"):
        case.run(paged_attention_triton)
    case = random_case(24, num_reqs=1)
    with pytest.raises(ValueError, match="num_kv_splits"):
        case.run(functools.partial(paged_attention_triton, num_kv_splits=0))
    for block_m in (8, 24, 2):  # below 16, not a power of two, below the GQA group (2 here)
        with pytest.raises(ValueError, match="block_m"):
            case.run(functools.partial(paged_attention_triton, multi_row=True, block_m=block_m))


@pytest.mark.parametrize("seed,window", [(20, None), (21, 5)])
def test_batch_invariant_mode_equals_the_twin_whatever_path_is_asked(seed, window):
    """batch_invariant=True runs the single-row kernel with INVARIANT_KV_SPLITS splits (overriding
    multi_row / num_kv_splits): same results as the twin, padding rows zero. The bits' independence
    of the batch is a property of the compiled kernels: tests/gpu/test_batch_invariant_gpu.py."""
    from blockdraft.attention.triton_attention import INVARIANT_KV_SPLITS

    kw = dict(num_heads=4, num_kv_heads=2, kv_block_size=8, sliding_window=window)
    case, twin, single = (random_case(seed, **kw) for _ in range(3))
    out = case.run(functools.partial(paged_attention_triton, batch_invariant=True, multi_row=True, num_kv_splits=2))
    torch.testing.assert_close(out, twin.run(paged_attention_dense), **TOL[case.q.dtype])
    assert torch.all(out[case.meta.row_req < 0] == 0)
    assert torch.equal(out, single.run(functools.partial(paged_attention_triton, multi_row=False,
                                                         num_kv_splits=INVARIANT_KV_SPLITS)))  # fmt: skip
