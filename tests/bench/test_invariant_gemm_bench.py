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


def test_rows_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        invariant_gemm.main(["--rows", "1", "0"])
    assert exc.value.code == 2 and "--rows must be >= 1, got [1, 0]" in capsys.readouterr().err
