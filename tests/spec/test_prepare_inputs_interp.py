"""The Triton drafter input preparation equals its torch twin, on CPU through Triton's interpreter."""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.spec.dflash.prepare_inputs_triton")

import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft.spec.dflash.prepare_inputs import DraftInputs, prepare_draft_inputs  # noqa: E402
from blockdraft.spec.dflash.prepare_inputs_triton import prepare_draft_inputs_triton  # noqa: E402
from tests.spec.prepare_cases import random_step  # noqa: E402
from tests.triton_interp import numpy_index_shim  # noqa: E402,F401  (autouse fixture)

MASK = 151_665


@pytest.mark.parametrize("seed,pad_sample", [(0, 0), (1, 2), (2, 0), (3, 1), (4, 0)])
def test_kernel_equals_twin(seed, pad_sample):
    case = random_step(seed, num_reqs=6, pad_sample=pad_sample)
    before = case.slot_mapping.clone()
    got = prepare_draft_inputs_triton(*case.args(), MASK)
    expected = prepare_draft_inputs(*case.args(), MASK)
    for name in DraftInputs.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(case.slot_mapping, before)


def test_int32_inputs():
    case = random_step(7, num_reqs=5)
    args = [x.int() for x in case.args()[:5]] + [case.slot_mapping]
    got = prepare_draft_inputs_triton(*args, MASK)
    expected = prepare_draft_inputs(*case.args(), MASK)
    for name in DraftInputs.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_no_sampling_requests():
    case = random_step(0, num_reqs=0, pad_rows=3)
    got = prepare_draft_inputs_triton(*case.args(), MASK)
    assert got.bonus_tokens.shape == (0,) and torch.equal(got.context_slot_mapping, case.slot_mapping)
