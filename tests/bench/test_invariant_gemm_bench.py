"""`python -m blockdraft.bench.invariant_gemm`: its refusal without a GPU and its shape list (the
timings need a GPU: docs/benchmarks/gpu.md "Session 43")."""

from __future__ import annotations

import pytest
import torch

from blockdraft.bench import invariant_gemm


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_needs_cuda(capsys):
    assert invariant_gemm.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_every_model_has_an_lm_head_and_the_sweep_holds_64_row_tiles():
    from blockdraft.bench.skinny_gemm import SHAPES

    assert set(invariant_gemm.LM_HEADS) == set(SHAPES)
    assert {t[4] for t in invariant_gemm.SWEEP} == {16, 64}  # the shipped rule's 64 and the first tiles' 16
