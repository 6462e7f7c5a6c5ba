"""The one-launch uniform-step preparation equals its torch twin, on CPU through Triton's interpreter."""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.spec.dflash.draft_block_triton")

import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft.spec.dflash.draft_block import uniform_step_inputs  # noqa: E402
from blockdraft.spec.dflash.draft_block_triton import uniform_step_inputs_triton  # noqa: E402
from tests.spec.uniform_cases import block_fields, random_uniform_step  # noqa: E402
from tests.triton_interp import numpy_index_shim  # noqa: E402,F401  (autouse fixture)

MASK = 151_665


@pytest.mark.parametrize("seed,num_real,num_padding,q,b", [
    (0, 1, 0, 16, 16), (1, 3, 2, 4, 16), (2, 4, 0, 6, 16), (3, 2, 3, 2, 2), (4, 5, 1, 3, 8),
])  # fmt: skip
def test_kernel_equals_twin(seed, num_real, num_padding, q, b):
    case = random_uniform_step(seed, num_real, num_padding, q)
    before = [x.clone() for x in case.args()]
    accepted, context, block = uniform_step_inputs_triton(*case.args(), b, MASK)
    want_accepted, want_context, want_block = uniform_step_inputs(*case.args(), b, MASK)
    assert torch.equal(accepted, want_accepted)  # padding requests' junk counts alike
    assert torch.equal(context, want_context)
    got, want = block_fields(block), block_fields(want_block)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert block.num_block_tokens == want_block.num_block_tokens == b
    assert all(torch.equal(x, y) for x, y in zip(case.args(), before))


def test_no_requests():
    case = random_uniform_step(0, 0, 0, 4)
    accepted, context, block = uniform_step_inputs_triton(*case.args(), 4, MASK)
    assert accepted.shape == (0,) and context.shape == (0,) and block.num_reqs == 0
    assert block.query_start_loc.tolist() == [0]
