"""The draft block and the uniform step's post-verify preparation (torch twin): a hand-written
example, a per-request loop over random padded steps, and the refusals."""

from __future__ import annotations

import pytest
import torch

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.spec.dflash.draft_block import build_draft_block, uniform_step_inputs
from tests.spec.uniform_cases import random_uniform_step

MASK = 99


def test_hand_written_step():
    """Two real requests (K = 2) and one padding request, whole blocks of B = 4 rows."""
    target = torch.tensor([[5, 6, 7], [8, 9, 1], [0, 0, 0]])
    input_ids = torch.tensor([4, 5, 3, 7, 8, 9, 0, 0, 0])  # request 0 accepts 1 draft, request 1 both
    row_req = torch.tensor([0, 0, 0, 1, 1, 1, -1, -1, -1], dtype=torch.int32)
    positions = torch.tensor([10, 11, 12, 20, 21, 22, 0, 0, 0])
    slots = torch.tensor([110, 111, 112, 220, 221, 222, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT])
    qsl = torch.tensor([0, 3, 6, 6], dtype=torch.int32)
    accepted, context, block = uniform_step_inputs(target, input_ids, row_req, positions, slots, qsl, 4, MASK)
    assert accepted[:2].tolist() == [1, 2]
    assert context.tolist() == [110, 111, PADDING_SLOT, 220, 221, 222] + [PADDING_SLOT] * 3
    assert block.token_ids.tolist() == [6, MASK, MASK, MASK, 1, MASK, MASK, MASK] + [MASK] * 4
    assert block.positions.tolist() == [12, 13, 14, 15, 23, 24, 25, 26, 0, 1, 2, 3]
    assert block.seq_lens.tolist() == [12, 23, 0] and block.seq_lens.dtype == torch.int32
    assert block.query_start_loc.tolist() == [0, 4, 8, 8] and block.query_start_loc.dtype == torch.int32
    assert block.row_req.tolist() == [0] * 4 + [1] * 4 + [-1] * 4
    assert block.slot_mapping.tolist() == [PADDING_SLOT] * 12 and block.num_block_tokens == 4


@pytest.mark.parametrize("seed,q,b", [(0, 4, 4), (1, 4, 16), (2, 16, 16), (3, 6, 16), (4, 2, 8)])
def test_twin_equals_a_per_request_loop(seed, q, b):
    case = random_uniform_step(seed, num_real=5, num_padding=2, q=q)
    before = [x.clone() for x in case.args()]
    accepted, context, block = uniform_step_inputs(*case.args(), b, MASK)
    ids = case.input_ids.view(-1, q)
    for r in range(7):
        real = int(case.row_req[r * q]) >= 0
        drafts, tokens = ids[r, 1:].tolist(), case.target[r].tolist()
        n = next((c for c in range(q - 1) if drafts[c] != tokens[c]), q - 1)
        rows = slice(r * b, (r + 1) * b)
        if real:
            assert int(accepted[r]) == n
            slots = case.slot_mapping[r * q : (r + 1) * q].tolist()
            assert context[r * q : (r + 1) * q].tolist() == slots[: n + 1] + [PADDING_SLOT] * (q - 1 - n)
            start = int(case.positions[r * q]) + 1 + n
            assert block.token_ids[rows].tolist() == [tokens[n]] + [MASK] * (b - 1)
            assert block.positions[rows].tolist() == list(range(start, start + b))
            assert int(block.seq_lens[r]) == start and block.row_req[rows].tolist() == [r] * b
        else:
            assert context[r * q : (r + 1) * q].tolist() == [PADDING_SLOT] * q
            assert block.token_ids[rows].tolist() == [MASK] * b and block.positions[rows].tolist() == list(range(b))
            assert int(block.seq_lens[r]) == 0 and block.row_req[rows].tolist() == [-1] * b
    assert block.query_start_loc.tolist() == [min(r, 5) * b for r in range(8)]
    assert all(torch.equal(x, y) for x, y in zip(case.args(), before))  # inputs untouched


def test_build_draft_block_dense_layout():
    block = build_draft_block(torch.tensor([7, 8]), torch.tensor([3, 5]), 3, MASK)
    assert block.token_ids.tolist() == [7, MASK, MASK, 8, MASK, MASK]
    assert block.positions.tolist() == [3, 4, 5, 5, 6, 7] and block.seq_lens.tolist() == [3, 5]
    assert block.query_start_loc.tolist() == [0, 3, 6] and block.row_req.tolist() == [0, 0, 0, 1, 1, 1]
    meta = block.attention_metadata(torch.zeros(2, 4, dtype=torch.int32), 16, host_lists=True)
    assert meta.num_block_tokens == 3 and meta.seq_lens_host == [3, 5] and meta.query_start_loc_host == [0, 3, 6]


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0].view(-1),) + a[1:], "target must be"),
    (lambda a: a[:1] + (a[1][:-1],) + a[2:], "input_ids has shape"),
    (lambda a: a[:5] + (a[5][:-1],), "query_start_loc has shape"),
])  # fmt: skip
def test_refuses_wrong_shapes(change, message):
    args = random_uniform_step(0, num_real=2, num_padding=1, q=4).args()
    with pytest.raises(ValueError, match=message):
        uniform_step_inputs(*change(args), 4, MASK)
    with pytest.raises(ValueError, match="num_block_tokens 3 is less than the 4 rows"):
        uniform_step_inputs(*args, 3, MASK)
