"""The sync-free drafter input preparation equals the runner's propose math (boolean-mask version)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.spec.dflash.prepare_inputs import DraftInputs, prepare_draft_inputs
from tests.spec.prepare_cases import pad_step, random_step

MASK = 151_665


def propose_math(case) -> DraftInputs:
    """The math of ModelRunner._propose (frozen copy, with the `rows[rejected]` boolean indexing
    that syncs)."""
    rows, num_accepted = case.logits_rows, case.num_accepted
    slot_in_block = torch.arange(rows.shape[1])
    rejected = (rows >= 0) & (slot_in_block[None, :] > num_accepted[:, None])
    slot_mapping = case.slot_mapping.clone()
    slot_mapping[case.logits_indices[rows[rejected]]] = PADDING_SLOT
    bonus = case.target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    anchor_positions = case.positions[case.logits_indices[rows[:, 0]]]
    bonus_positions = anchor_positions + 1 + num_accepted
    return DraftInputs(slot_mapping, bonus, bonus_positions)


def assert_equal(a: DraftInputs, b: DraftInputs) -> None:
    for name in DraftInputs.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.long, name
        assert torch.equal(x, y), name


@pytest.mark.parametrize("seed", range(40))
def test_equals_propose_math(seed):
    case = random_step(seed, num_reqs=1 + seed % 7, max_drafts=1 + seed % 9)
    before = [x.clone() for x in case.args()]
    got = prepare_draft_inputs(*case.args(), MASK)
    assert_equal(got, propose_math(case))
    assert all(torch.equal(x, y) for x, y in zip(before, case.args()))  # inputs untouched


def test_rejected_rows_are_exactly_the_unaccepted_drafts():
    case = random_step(3, num_reqs=6, pad_rows=0)
    got = prepare_draft_inputs(*case.args(), MASK)
    cleared = (got.context_slot_mapping != case.slot_mapping).nonzero().flatten().tolist()
    expected = []
    for s in range(case.logits_rows.shape[0]):
        k = int((case.logits_rows[s] >= 0).sum()) - 1
        rejected_columns = range(int(case.num_accepted[s]) + 1, k + 1)
        expected += [int(case.logits_indices[case.logits_rows[s, c]]) for c in rejected_columns]
    assert expected and sorted(cleared) == sorted(expected)
    assert torch.all(got.context_slot_mapping[cleared] == PADDING_SLOT)


def test_padding_sampling_requests_get_mask_bonus_at_position_zero():
    case = random_step(5, pad_sample=3)
    got = prepare_draft_inputs(*case.args(), MASK)
    real = case.logits_rows.shape[0] - 3
    ref = propose_math(random_step(5))
    assert torch.equal(got.context_slot_mapping, ref.context_slot_mapping)
    assert torch.equal(got.bonus_tokens[:real], ref.bonus_tokens)
    assert torch.equal(got.bonus_positions[:real], ref.bonus_positions)
    assert torch.all(got.bonus_tokens[real:] == MASK) and torch.all(got.bonus_positions[real:] == 0)


def test_no_sampling_requests():
    case = random_step(0, num_reqs=0, pad_rows=3)
    got = prepare_draft_inputs(*case.args(), MASK)
    assert got.bonus_tokens.shape == (0,) and got.bonus_positions.shape == (0,)
    assert torch.equal(got.context_slot_mapping, case.slot_mapping)


def test_shape_errors():
    case = random_step(1)
    with pytest.raises(ValueError, match="num_accepted"):
        prepare_draft_inputs(case.logits_rows, case.logits_indices, case.num_accepted[:-1], case.target_tokens,
                             case.positions, case.slot_mapping, MASK)  # fmt: skip
    with pytest.raises(ValueError, match="target_tokens"):
        prepare_draft_inputs(case.logits_rows, case.logits_indices, case.num_accepted, case.target_tokens[:, :1],
                             case.positions, case.slot_mapping, MASK)  # fmt: skip


def test_padded_bucket_keeps_real_outputs():
    """Padding a step to bucket shapes (extra sampling requests, columns, logits and forward rows)
    changes nothing for the real requests and rows."""
    for seed in range(10):
        case = random_step(seed, num_reqs=6, max_drafts=7)
        padded = pad_step(case, num_sample=8, width=10, num_logits=60, num_rows=80)
        got, ref = prepare_draft_inputs(*padded.args(), MASK), prepare_draft_inputs(*case.args(), MASK)
        s, t = ref.bonus_tokens.shape[0], ref.context_slot_mapping.shape[0]
        assert torch.equal(got.context_slot_mapping[:t], ref.context_slot_mapping)
        assert torch.all(got.context_slot_mapping[t:] == PADDING_SLOT)
        assert torch.equal(got.bonus_tokens[:s], ref.bonus_tokens)
        assert torch.equal(got.bonus_positions[:s], ref.bonus_positions)
