"""`python -m blockdraft.bench.skinny_gemm`: argument checks and the table row (the timings
themselves need a GPU: tests/gpu and the bench runs in docs/benchmarks/gpu.md "Session 14")."""

from __future__ import annotations

import pytest
import torch

from blockdraft.bench import skinny_gemm


@pytest.mark.parametrize("rows", ["0", "17"])
def test_rows_outside_1_to_16_are_refused(rows, capsys):
    with pytest.raises(SystemExit) as exc:
        skinny_gemm.main(["--rows", "1", rows])
    assert exc.value.code == 2 and f"--rows must be in [1, 16], got [1, {rows}]" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_needs_cuda(capsys):
    with pytest.raises(SystemExit):
        skinny_gemm.main([])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_table_row_shows_the_gain_or_cublas():
    rec = dict(K=896, N=1152, rows=1, weight_mb=2.06, floor_us=0.49, cublas_us=3.97, chosen_us=2.33,
               chosen=["row", 4, 1024, 8, 3])  # fmt: skip
    assert skinny_gemm.format_row("qwen2.5-0.5b", "qkv", rec).split()[-1] == "1.70x"
    swiglu = skinny_gemm.format_row("qwen2.5-0.5b", "down", dict(rec, two_launch_swiglu_us=7.5, fused_swiglu_us=5.9))
    assert swiglu.endswith("1.70x | swiglu 7.50 -> 5.90")
    kept = dict(rec, chosen=None, chosen_us=None)
    assert skinny_gemm.format_row("qwen2.5-0.5b", "qkv", kept).split()[-2:] == ["-", "-"]


def test_every_listed_shape_is_a_real_linear():
    """The shapes the bench times include every entry of the shipped tables (so a rerun
    re-measures what ships)."""
    from blockdraft.kernels.skinny_gemm import _SM90_ONE_ROW, _SM90_SIXTEEN_ROWS

    listed = {(k, n) for shapes in skinny_gemm.SHAPES.values() for _, k, n in shapes}
    assert set(_SM90_ONE_ROW) | set(_SM90_SIXTEEN_ROWS) <= listed


def test_unknown_linear_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        skinny_gemm.main(["--models", "qwen3-8b", "--linears", "qkv", "mlp"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--linears ['mlp'] not among" in err and "'draft_kv'" in err
