"""Batch-invariant GEMM (`blockdraft.kernels.invariant_gemm`) == F.linear on CPU through Triton's
interpreter, each row's bits independent of the row count, and the dispatch from `fused_ops`.
Compiled at real shapes (and the invariance on tensor cores): tests/gpu/test_batch_invariant_gpu.py.
fp32 (IEEE dot) and fp16 only: the interpreter multiplies bf16 tl.dot operands as raw bits.
"""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.kernels.invariant_gemm")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from blockdraft.kernels import invariant_gemm  # noqa: E402
from blockdraft.kernels.invariant_gemm import config_for, invariant_linear  # noqa: E402
from blockdraft.layers import fused_ops  # noqa: E402
from tests.triton_interp import numpy_index_shim  # noqa: E402,F401  (autouse fixture)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [1, 5, 16, 37, 70])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_equals_f_linear(dtype, rows, with_bias):
    # K = 150 (two K tiles of 128, the second partial), N = 37 (two column blocks of 32, the last
    # partial), 37 rows (one row block of 64, partial; 70 rows would take two); x is a strided view
    x = rand(rows, 160, dtype=dtype, seed=1)[:, :150]
    w = rand(37, 150, dtype=dtype, seed=2) * 0.1
    b = rand(37, dtype=dtype, seed=3) if with_bias else None
    out = invariant_linear(x, w, b)
    assert out.shape == (rows, 37) and out.dtype == dtype and out.is_contiguous()
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_each_row_is_the_same_bits_whatever_the_row_count():
    x = rand(70, 150, dtype=torch.float16, seed=4)  # two row blocks of 64
    w = rand(40, 150, dtype=torch.float16, seed=5) * 0.1
    full = invariant_linear(x, w)
    for rows in (1, 2, 16, 17, 64, 65):
        assert torch.equal(invariant_linear(x[:rows].contiguous(), w), full[:rows]), rows
    garbage = x.clone()
    garbage[1:] = 1e3  # other rows' values take no part in row 0
    assert torch.equal(invariant_linear(garbage, w)[0], full[0])


def test_float32_output_keeps_the_accumulation_and_writes_into_out():
    x = rand(3, 64, dtype=torch.float16, seed=6)
    w = rand(20, 64, dtype=torch.float16, seed=7) * 0.1
    exact = x.double() @ w.double().t()
    got = invariant_linear(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    out = torch.full((3, 20), float("nan"))
    assert invariant_linear(x, w, out_dtype=torch.float32, out=out) is out and torch.equal(out, got)


@pytest.mark.parametrize("bad, match", [
    (dict(w=torch.zeros(4, 9)), r"x must be \[rows, in\]"),
    (dict(x=torch.zeros(2, 8, dtype=torch.int32)), "float16, bfloat16 or float32"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float16)), "share one dtype"),
    (dict(w=torch.zeros(8, 4).t()), "weight must be contiguous"),
    (dict(b=torch.zeros(5)), r"bias must be a contiguous \[4\]"),
    (dict(out=torch.zeros(2, 5)), r"out must be \[2, 4\]"),
])  # fmt: skip
def test_bad_arguments_name_what_is_wrong(bad, match):
    args = dict(x=torch.zeros(2, 8), w=torch.zeros(4, 8), b=None, out=None) | bad
    with pytest.raises(ValueError, match=match):
        invariant_linear(args["x"], args["w"], args["b"], out=args["out"])


def test_shipped_tiles_are_the_swept_ones_and_shrink_to_fit_smaller_gpus():
    h100, a100, ada = 232448, 166912, 101376  # shared memory per block (opt-in), bytes
    assert config_for(4864, 896, torch.bfloat16, h100) == (32, 256, 4, 4, 64)  # as swept
    assert config_for(4864, 896, torch.bfloat16, a100) == (32, 256, 4, 3, 64)  # 4 stages = 192 KiB
    assert config_for(4864, 896, torch.bfloat16, ada) == (32, 128, 4, 2, 64)
    assert config_for(4096, 24576, torch.bfloat16, ada) == (64, 128, 4, 2, 64)
    assert config_for(896, 896, torch.bfloat16) == (32, 128, 4, 4, 64)  # narrow outputs
    assert config_for(896, 151936, torch.bfloat16) == (64, 128, 4, 3, 64)  # an LM head
    assert config_for(4864, 896, torch.bfloat16) == (32, 256, 4, 4, 64)  # a down projection
    assert config_for(40, 37, torch.float32) == (32, 64, 4, 2, 64)
    assert all(config_for(k, n, torch.bfloat16).block_m == invariant_gemm.BLOCK_M for k, n in [(8, 8), (9999, 99999)])


def test_fused_ops_linear_takes_it_in_batch_invariant_mode(monkeypatch):
    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    calls = []
    real = invariant_gemm.invariant_linear
    def counting(x, *a, **k):
        calls.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(fused_ops._kernels(), "invariant_linear", counting)
    x, w = rand(20, 64, seed=8), rand(24, 64, seed=9) * 0.1
    for rows in (1, 16, 20):  # every row count, also past the skinny kernels' 16
        got = fused_ops.linear(x[:rows], w, None, fused=False, invariant=True)
        torch.testing.assert_close(got, F.linear(x[:rows], w), **TOL[torch.float32])
    mlp = fused_ops.swiglu_mlp(x[:3], rand(48, 64, seed=10) * 0.1, rand(64, 24, seed=11) * 0.1, invariant=True)
    assert mlp.shape == (3, 64)
    assert calls == [1, 16, 20, 3, 3]  # the MLP's gate/up and down projections too
