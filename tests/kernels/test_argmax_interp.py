"""The two-launch row argmax == torch.argmax, on CPU through Triton's interpreter.

Small chunks make every row span several stage-1 programs, so the cross-piece tie and NaN rules
are exercised; the compiled kernel at vocabulary width is checked under tests/gpu.
"""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.kernels.argmax")

import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft.kernels.argmax import argmax_rows  # noqa: E402
from blockdraft.layers import fused_ops  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n_cols", [1, 15, 64, 100, 333])
def test_random_rows_equal_torch(dtype, n_cols):
    g = torch.Generator().manual_seed(n_cols)
    x = torch.randn(5, n_cols, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x, chunk=32), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_ties_go_to_the_lowest_index_across_pieces(dtype):
    x = torch.zeros(6, 130, dtype=dtype)
    x[0, [40, 7, 100]] = 3.0  # tie in different pieces (chunk 32): 7 wins
    x[1, [33, 34]] = 2.0  # tie inside one piece
    x[2, [129, 96]] = 1.0  # tie in the last, partial piece
    x[3] = float("-inf")  # all -inf: index 0, like torch
    x[4, 0] = float("inf")
    x[4, 64] = float("inf")
    # row 5: all zeros -> 0
    out = argmax_rows(x, chunk=32)
    assert torch.equal(out, torch.argmax(x, dim=-1))
    assert out.tolist() == [7, 33, 96, 0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_nan_beats_everything_and_the_first_nan_wins(dtype):
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 70] = float("nan")
    x[1, [90, 10, 50]] = float("nan")  # first NaN in column order, not piece order
    x[2, 5] = float("inf")
    x[2, 99] = float("nan")  # NaN beats +inf
    x[3, :] = float("nan")
    out = argmax_rows(x, chunk=16)
    assert out.tolist() == [70, 10, 99, 0]
    assert torch.equal(out, torch.argmax(x, dim=-1))


def test_writes_into_a_strided_out_and_reads_a_row_strided_view():
    base = torch.randn(4, 200, generator=torch.Generator().manual_seed(1))
    x = base[:, 10:150]  # row stride 200, unit column stride
    buf = torch.full((8,), -5, dtype=torch.int64)
    out = argmax_rows(x, out=buf[::2], chunk=64)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[::2], torch.argmax(x, dim=-1))
    assert buf[1::2].tolist() == [-5] * 4  # untouched between the strided slots


def test_zero_rows_and_bad_inputs():
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        argmax_rows(torch.randn(10))
    with pytest.raises(ValueError, match="V >= 1"):
        argmax_rows(torch.empty(3, 0))
    with pytest.raises(ValueError, match="int32"):
        argmax_rows(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="unit column stride"):
        argmax_rows(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="chunk"):
        argmax_rows(torch.randn(2, 4), chunk=24)
    with pytest.raises(ValueError, match=r"out must be \[2\] int64"):
        argmax_rows(torch.randn(2, 4), out=torch.empty(2, dtype=torch.int32))


def test_fused_ops_argmax_dispatch(monkeypatch):
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = torch.empty(3, dtype=torch.int64)
    calls = []
    real = fused_ops._kernels().argmax_rows
    monkeypatch.setattr(fused_ops._kernels(), "argmax_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(fused_ops.argmax(x, True, out=out), torch.argmax(x, dim=-1))  # CPU: the twin
    assert not calls
    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    assert torch.equal(fused_ops.argmax(x, True, out=out), torch.argmax(x, dim=-1))
    assert calls and torch.equal(out, torch.argmax(x, dim=-1))
    assert torch.equal(fused_ops.argmax(x, False), torch.argmax(x, dim=-1)) and len(calls) == 1
    xt = torch.randn(50, 3).t()  # non-unit column stride: the twin, not an error
    assert torch.equal(fused_ops.argmax(xt, True), torch.argmax(xt, dim=-1)) and len(calls) == 1
