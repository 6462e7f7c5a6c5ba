"""Bucket sizes, uniform-step detection and the inert padding layout of a padded batch."""

import pytest
import torch

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.engine.outputs import ScheduledRequest, SchedulerOutput
from blockdraft.runner.cuda_graphs import StaticInputs, capture_sizes
from blockdraft.runner.input_batch import BatchPadding, build_input_batch
from blockdraft.runner.staging import start_fetch
from blockdraft.runner.step_output import fetch_step_output, pack_step
from blockdraft.sampling_params import SamplingParams


def test_capture_sizes_are_powers_of_two_then_the_cap():
    assert capture_sizes(64, 512, 1) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(64, 512, 16) == [1, 2, 4, 8, 16, 32]  # 512 // 16 rows
    assert capture_sizes(48, 8192, 8) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1, 512, 1) == [1]
    assert capture_sizes(64, 8, 16) == []  # not even one verify block fits the token budget


def _req(rid, n, start, k, pages, sample=True):
    return ScheduledRequest(rid, list(range(1, n + 1)), start, k, sample, pages, SamplingParams(seed=1))


def test_padded_batch_layout_is_inert_padding():
    so = SchedulerOutput([_req("a", 3, 5, 2, [7, 2]), _req("b", 3, 9, 2, [4, 5, 6])])
    b = build_input_batch(so, 4, "cpu", host_metadata=False, padding=BatchPadding(4, 12, 5))
    assert b.num_reqs == 2 and b.num_rows == 6 and b.meta.num_reqs == 4
    assert b.meta.query_start_loc.tolist() == [0, 3, 6, 6, 6]
    assert b.meta.seq_lens.tolist() == [8, 12, 0, 0]
    assert b.meta.row_req.tolist() == [0, 0, 0, 1, 1, 1] + [-1] * 6
    assert b.slot_mapping[6:].tolist() == [PADDING_SLOT] * 6
    assert b.slot_mapping[:6].tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert b.meta.block_table.tolist() == [[7, 2, 0, 0, 0], [4, 5, 6, 0, 0], [0] * 5, [0] * 5]
    assert b.meta.query_start_loc_host is None and b.meta.seq_lens_host is None
    assert b.logits_indices.tolist() == list(range(6))
    with pytest.raises(ValueError, match="does not fit the padding"):
        build_input_batch(so, 4, "cpu", padding=BatchPadding(1, 12, 5))


def test_static_block_table_is_written_only_as_wide_as_steps_need_yet_reads_as_written_whole():
    """Steps write max(widest request, columns written before) columns of the graphs' static
    table (M = 64 here), never M; after every step its rows equal the full-width table."""
    static = StaticInputs.allocate(4, 1, 64, "cpu")
    steps = [
        [_req("a", 1, 5, 0, [7, 2]), _req("b", 1, 9, 0, [4, 5, 6, 9])],  # 4 columns
        [_req("c", 1, 2, 0, [3])],  # narrower: still writes 4, zeroing a's and b's old pages in row 0
        [_req("d", 1, 2, 0, [8, 1, 2, 3, 10, 11]), _req("e", 1, 2, 0, [12])],  # wider: 6
    ]
    for reqs in steps:
        so = SchedulerOutput(reqs)
        width = static.table_width(so.requests)
        assert width == max(static.block_table_cols, max(len(r.block_ids) for r in reqs)) < 64
        padding = BatchPadding(len(reqs), len(reqs), width)
        static.load(build_input_batch(so, 4, "cpu", host_metadata=False, padding=padding))
        whole = build_input_batch(so, 4, "cpu", host_metadata=False, padding=BatchPadding(len(reqs), len(reqs), 64))
        assert torch.equal(static.block_table[: len(reqs)], whole.meta.block_table)
    assert static.block_table_cols == 6 and not static.block_table[:, 6:].any()
    # a table narrower than what was written (no engine path makes one) still reads exactly
    static.write_block_table(torch.tensor([[5, 6]], dtype=torch.int32))
    assert static.block_table[0].tolist() == [5, 6] + [0] * 62


def test_slot_mapping_follows_each_requests_pages_across_page_boundaries():
    # a prefill chunk starting mid-page over three pages, a decode row, a prefill from 0 onto page 0
    so = SchedulerOutput([_req("a", 7, 2, 0, [9, 3, 5], sample=False), _req("b", 1, 4, 0, [6, 1]),
                          _req("c", 5, 0, 0, [8, 0])])
    want = [sr.block_ids[p // 4] * 4 + p % 4
            for sr in so.requests for p in range(sr.start_position, sr.start_position + len(sr.token_ids))]
    assert build_input_batch(so, 4, "cpu").slot_mapping.tolist() == want
    padded = build_input_batch(so, 4, "cpu", host_metadata=False, padding=BatchPadding(4, 16, 3))
    assert padded.slot_mapping.tolist() == want + [PADDING_SLOT] * 3


def test_one_packed_tensor_carries_tokens_accepted_counts_and_drafts():
    so = SchedulerOutput([_req("a", 3, 5, 2, [7, 2]), _req("b", 1, 0, 0, [1], sample=False), _req("c", 1, 9, 0, [3, 4, 8])])
    batch = build_input_batch(so, 4, "cpu")
    target = torch.tensor([[11, 12, 13], [21, -1, -1]])
    packed = pack_step(target, torch.tensor([1, 0]), torch.tensor([[5, 6], [7, 8]]))
    out = fetch_step_output(so, batch, start_fetch(packed))
    assert out.sampled_token_ids == {"a": [11, 12], "c": [21]}
    assert out.num_accepted == {"a": 1, "c": 0}
    assert out.draft_token_ids == {"a": [5, 6], "c": [7, 8]}
    plain = fetch_step_output(so, batch, start_fetch(pack_step(target, torch.tensor([2, 0]), None)))
    assert plain.sampled_token_ids == {"a": [11, 12, 13], "c": [21]} and plain.draft_token_ids == {}


def test_draft_block_layout_widens_each_request_of_a_padded_step():
    """The draft-block layout with whole blocks (B = 16) over a padded K = 3 step: each real
    request owns 16 rows in order, padding requests stay empty and their rows -1; with B = Q the
    target's own layout is passed through."""
    from blockdraft.spec.dflash.draft_block import widen_layout

    so = SchedulerOutput([_req("a", 4, 5, 3, [7, 2]), _req("b", 4, 9, 3, [4, 5, 6])])
    b = build_input_batch(so, 4, "cpu", host_metadata=False, padding=BatchPadding(4, 16, 5))
    qsl, row_req = widen_layout(b.meta.query_start_loc[:5], b.meta.row_req[:16], 4, 16)
    assert qsl.tolist() == [0, 16, 32, 32, 32] and qsl.dtype == torch.int32
    assert row_req.tolist() == [0] * 16 + [1] * 16 + [-1] * 32 and row_req.dtype == b.meta.row_req.dtype
    # one request: a fresh contiguous copy, not a stride-0 view of the static buffer (kernels read
    # row_req[row]; the view read past the request's first row on the H200, session 24)
    qsl, row_req = widen_layout(b.meta.query_start_loc[:2], b.meta.row_req[:4], 4, 16)
    assert qsl.tolist() == [0, 16] and row_req.tolist() == [0] * 16 and row_req.is_contiguous()
    qsl, row_req = widen_layout(b.meta.query_start_loc[:5], b.meta.row_req[:16], 4, 4)
    assert qsl is not None and qsl.data_ptr() == b.meta.query_start_loc.data_ptr() and row_req.numel() == 16
