"""Compiled Triton drafter input preparation == its torch twin on CUDA (random steps, no host
sync, CUDA-graph replay). Run on a GPU machine: `python -m pytest -q tests/gpu`."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.spec.dflash.prepare_inputs import DraftInputs, prepare_draft_inputs  # noqa: E402
from blockdraft.spec.dflash.prepare_inputs_triton import prepare_draft_inputs_triton  # noqa: E402
from tests.gpu.cuda_util import capture, no_host_sync, poison_allocator  # noqa: E402
from tests.spec.prepare_cases import pad_step, random_step  # noqa: E402

pytestmark = [pytest.mark.gpu]
MASK = 151_665


def assert_same(a: DraftInputs, b: DraftInputs) -> None:
    for name in DraftInputs.__dataclass_fields__:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("fn", [prepare_draft_inputs_triton, prepare_draft_inputs], ids=["triton", "twin"])
def test_matches_cpu_twin(fn):
    for seed in range(30):
        case = random_step(seed, num_reqs=1 + seed, max_drafts=15, pad_sample=seed % 3)
        expected = prepare_draft_inputs(*case.args(), MASK)
        poison_allocator()
        got = fn(*case.to("cuda").args(), MASK)
        assert_same(DraftInputs(*(x.cpu() for x in vars(got).values())), expected)


@pytest.mark.parametrize("fn", [prepare_draft_inputs_triton, prepare_draft_inputs], ids=["triton", "twin"])
def test_no_host_sync(fn):
    case = random_step(1, num_reqs=8, pad_sample=1).to("cuda")
    fn(*case.args(), MASK)
    with no_host_sync():
        fn(*case.args(), MASK)


@pytest.mark.parametrize("fn", [prepare_draft_inputs_triton, prepare_draft_inputs], ids=["triton", "twin"])
def test_cuda_graph_replay(fn):
    """Same shapes, new contents: a captured call follows the new step."""
    bucket = dict(num_sample=10, width=16, num_logits=160, num_rows=200)
    static = pad_step(random_step(10, num_reqs=8, max_drafts=15), **bucket).to("cuda")
    graph, out = capture(lambda: fn(*static.args(), MASK))
    for seed in range(11, 31):
        case = pad_step(random_step(seed, num_reqs=1 + seed % 10, max_drafts=15), **bucket)
        for dst, src in zip(static.args(), case.to("cuda").args()):
            dst.copy_(src)
        graph.replay()
        assert_same(DraftInputs(*(x.cpu() for x in vars(out).values())), prepare_draft_inputs(*case.args(), MASK))


# The uniform step's one-launch preparation (spec.dflash.draft_block): verification, context slots
# and the draft block, against its torch twin on the CPU.
from blockdraft.spec.dflash.draft_block import uniform_step_inputs  # noqa: E402
from blockdraft.spec.dflash.draft_block_triton import uniform_step_inputs_triton  # noqa: E402
from tests.spec.uniform_cases import block_fields, random_uniform_step  # noqa: E402


def assert_same_uniform(got, want) -> None:
    (accepted, context, block), (want_accepted, want_context, want_block) = got, want
    assert torch.equal(accepted.cpu(), want_accepted) and torch.equal(context.cpu(), want_context)
    fields, want_fields = block_fields(block), block_fields(want_block)
    assert fields.keys() == want_fields.keys()
    for name, value in want_fields.items():
        assert fields[name].dtype == value.dtype and torch.equal(fields[name], value), name


@pytest.mark.parametrize("fn", [uniform_step_inputs_triton, uniform_step_inputs], ids=["triton", "twin"])
@pytest.mark.parametrize("q,b", [(16, 16), (6, 16), (4, 4)])
def test_uniform_step_matches_cpu_twin(fn, q, b):
    for seed in range(20):
        case = random_uniform_step(seed, num_real=1 + seed % 9, num_padding=seed % 3, q=q)
        want = uniform_step_inputs(*case.args(), b, MASK)
        poison_allocator()
        assert_same_uniform(fn(*case.to("cuda").args(), b, MASK), want)


@pytest.mark.parametrize("fn", [uniform_step_inputs_triton, uniform_step_inputs], ids=["triton", "twin"])
def test_uniform_step_no_host_sync_and_graph_replay(fn):
    """No host sync; captured once, a replay follows new step contents of the same bucket."""
    static = random_uniform_step(0, num_real=6, num_padding=2, q=6).to("cuda")
    fn(*static.args(), 16, MASK)
    with no_host_sync():
        fn(*static.args(), 16, MASK)
    graph, out = capture(lambda: fn(*static.args(), 16, MASK))
    for seed in range(1, 12):
        case = random_uniform_step(seed, num_real=1 + seed % 8, num_padding=8 - (1 + seed % 8), q=6)
        for dst, src in zip(static.args(), case.to("cuda").args()):
            dst.copy_(src)
        graph.replay()
        assert_same_uniform(out, uniform_step_inputs(*case.args(), 16, MASK))
