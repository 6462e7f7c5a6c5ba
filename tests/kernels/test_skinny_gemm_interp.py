"""Skinny-GEMM kernels (1-16 rows) == F.linear, on CPU through Triton's interpreter, and the
dispatch that picks them (`config_for`, `fused_ops.linear`). Tiny shapes with small tiles so K
and N leave partial tiles; the compiled kernels at real shapes are checked under tests/gpu.
fp32 (IEEE dot) and fp16 only: the 3.6 interpreter multiplies bf16 tl.dot operands as raw bits.
"""

from __future__ import annotations

from tests.triton_interp import require_interpreter

require_interpreter("blockdraft.kernels.skinny_gemm", "blockdraft.kernels.activation")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from blockdraft.kernels.activation import silu_mul  # noqa: E402
from blockdraft.kernels.skinny_gemm import (  # noqa: E402
    MAX_ROWS,
    SkinnyConfig,
    config_for,
    one_row_rule,
    skinny_linear,
    skinny_swiglu,
    swiglu_config_for,
)
from blockdraft.layers import fused_ops  # noqa: E402
from blockdraft.layers.linear import Linear  # noqa: E402
from tests.triton_interp import numpy_index_shim  # noqa: E402,F401  (autouse fixture)

CPU = torch.device("cpu")
ROW = SkinnyConfig("row", 8, 16, 4, 2)
DOT = SkinnyConfig("dot", 16, 16, 4, 2)
# 4 programs per column block over K = 40 (3 K tiles of 16: one split gets none), partials added
DOT_SPLIT = SkinnyConfig("dot", 16, 16, 4, 2, 4)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", [ROW, DOT, DOT_SPLIT], ids=["row", "dot", "dot_split4"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_equals_f_linear(dtype, config, rows, with_bias):
    # K = 40 and N = 37 leave partial K and N tiles; x is a strided view (row stride 50).
    x = rand(rows, 50, dtype=dtype, seed=1)[:, :40]
    w = rand(37, 40, dtype=dtype, seed=2) * 0.2
    b = rand(37, dtype=dtype, seed=3) if with_bias else None
    out = skinny_linear(x, w, b, config)
    assert out.shape == (rows, 37) and out.dtype == dtype and out.is_contiguous()
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("config", [ROW, DOT, DOT_SPLIT], ids=["row", "dot", "dot_split4"])
def test_each_row_depends_only_on_itself(config):
    """A row's bits do not depend on the other rows of its block: the same row in two blocks that
    differ everywhere else gives the same bits, and alone (masked padding rows) the block's value.
    Here tl.dot runs numpy's matmul, whose BLAS kernel may round a row by its place in the tile
    (OpenBLAS 0.3.31 does for rows 6-11, by ~1 ulp), so for the dot kernels "alone" is held to
    rounding; the GPU holds it bit for bit (tests/gpu/test_fused_ops_gpu.py)."""
    x, w, other = rand(16, 40, seed=4), rand(37, 40, seed=5), rand(16, 40, seed=6)
    block = skinny_linear(x, w, None, config)
    for row in (0, 7, 15):
        mixed = other.clone()
        mixed[row] = x[row]
        assert torch.equal(skinny_linear(mixed, w, None, config)[row], block[row])
        alone = skinny_linear(x[row : row + 1], w, None, config)[0]
        if config.kernel == "row":
            assert torch.equal(alone, block[row])
        else:
            torch.testing.assert_close(alone, block[row], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", [ROW, DOT, DOT_SPLIT], ids=["row", "dot", "dot_split4"])
@pytest.mark.parametrize("rows", [1, 16])
def test_gated_input_equals_the_activation_kernel_then_the_gemm(dtype, config, rows):
    """up=...: (silu(gate) * up) @ W.T in one launch == silu_mul kernel, then the same GEMM, bit
    for bit (same rounding of the activation). gate / up are the halves of a stacked output."""
    gate_up = rand(rows, 80, dtype=dtype, seed=12) * 3
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    w, b = rand(37, 40, dtype=dtype, seed=13) * 0.2, rand(37, dtype=dtype, seed=14)
    fused = skinny_linear(gate, w, b, config, up=up)
    assert torch.equal(fused, skinny_linear(silu_mul(gate, up), w, b, config))
    expected = F.linear(fused_ops.silu_mul_ref(gate, up).float(), w.float(), b.float()).to(dtype)
    torch.testing.assert_close(fused, expected, **TOL[dtype])


def test_split_k_leaves_its_counters_at_zero_and_is_repeatable():
    from blockdraft.kernels import skinny_gemm

    x, w, b = rand(16, 40, seed=9), rand(37, 40, seed=10), rand(37, seed=11)
    first = skinny_linear(x, w, b, DOT_SPLIT)
    for split in (2, 8):
        torch.testing.assert_close(skinny_linear(x, w, b, DOT_SPLIT._replace(split_k=split)), first, **TOL[torch.float32])
    assert torch.equal(skinny_linear(x, w, b, DOT_SPLIT), first)
    assert int(skinny_gemm._SPLIT_COUNTERS[CPU].abs().sum()) == 0


def test_config_choice_off_sm90_and_when_switched_off(monkeypatch):
    from blockdraft.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "_is_sm90", lambda index: False)
    assert config_for(1, 896, 1152, torch.device("cuda", 0)) is None  # other GPUs: cuBLAS
    monkeypatch.setattr(skinny_gemm, "_is_sm90", lambda index: True)
    assert config_for(1, 896, 1152, torch.device("cuda", 0)) is not None
    monkeypatch.setattr(skinny_gemm, "ENABLED", False)  # BLOCKDRAFT_SKINNY_GEMM=0 at import
    assert config_for(1, 896, 1152, torch.device("cuda", 0)) is None and config_for(1, 896, 1152, CPU) is None


def test_the_switch_is_read_from_the_environment_at_import():
    import os
    import subprocess
    import sys

    code = "from blockdraft.kernels import skinny_gemm; print(skinny_gemm.ENABLED)"
    for value, expected in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "BLOCKDRAFT_SKINNY_GEMM": value})  # fmt: skip
        assert out.stdout.strip() == expected


def test_swiglu_fuses_one_row_of_the_measured_shapes_only():
    from blockdraft.kernels.skinny_gemm import fuses_swiglu

    assert fuses_swiglu(1, 12288, 4096) and fuses_swiglu(1, 1536, 576)  # Qwen3-8B, SmolLM2 down
    assert not fuses_swiglu(1, 4864, 896)  # Qwen2.5-0.5B down: even, not taken
    assert not fuses_swiglu(16, 12288, 4096) and not fuses_swiglu(2, 1536, 576)


def test_config_choice():
    table_one, table_sixteen = config_for(1, 896, 1152, CPU), config_for(16, 896, 1152, CPU)
    assert table_one == SkinnyConfig("row", 4, 1024, 8, 3) and table_sixteen.kernel == "dot"
    assert config_for(1, 100, 300, CPU) == one_row_rule(100, 300)  # unmeasured: the rule
    assert config_for(8, 100, 300, CPU) is None  # unmeasured, several rows: cuBLAS
    assert config_for(4, 4864, 896, CPU).split_k == 4  # narrow output at 16 rows: split over K
    assert config_for(4, 20480, 4096, CPU) is None  # cuBLAS measured as fast at 16 rows
    assert config_for(1, 896, 32768, CPU) is None  # measured: cuBLAS faster than the rule's tiles
    assert config_for(1, 896, 151936, CPU) is None  # beyond the sizes the rule was checked at
    assert config_for(0, 896, 1152, CPU) is None and config_for(MAX_ROWS + 1, 896, 1152, CPU) is None


@pytest.mark.parametrize(
    "shape,block_n", [((896, 1152), 4), ((896, 896), 4), ((4864, 896), 4), ((4096, 4096), 16), ((12288, 4096), 16)]
)
def test_one_row_rule_reproduces_the_measured_block_widths(shape, block_n):
    assert one_row_rule(*shape).block_n == block_n


def test_refusals():
    x, w = rand(2, 8), rand(4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(x, w, rand(8)[::2], ROW)  # a strided bias would be read as contiguous
    with pytest.raises(ValueError, match="unit column stride"):
        skinny_linear(rand(8, 2).t(), w, None, ROW)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        skinny_linear(x.double(), w.double(), None, ROW)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x.half(), w, None, ROW)
    with pytest.raises(ValueError, match=r"\[rows, in\]"):
        skinny_linear(x, rand(4, 9), None, ROW)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear(rand(17, 8), w, None, DOT)
    with pytest.raises(ValueError, match="'row' or 'dot'"):
        skinny_linear(x, w, None, SkinnyConfig("tile", 8, 16, 4, 2))
    for bad_up in (rand(2, 9), rand(2, 8).half(), rand(8, 2).t()):
        with pytest.raises(ValueError, match="up must match x"):
            skinny_linear(x, w, None, ROW, up=bad_up)
    for bad in (SkinnyConfig("dot", 16, 16, 4, 2, 3), SkinnyConfig("row", 8, 16, 4, 2, 2)):
        with pytest.raises(ValueError, match="split_k"):
            skinny_linear(x, w, None, bad)


def test_linear_dispatch(monkeypatch):
    """Half precision with a config takes the kernel; fp32, autograd and unmeasured multi-row
    shapes stay on F.linear (bit for bit)."""
    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    calls = []
    real = fused_ops._kernels().skinny_linear
    monkeypatch.setattr(fused_ops._kernels(), "skinny_linear", lambda *a: calls.append(a[3]) or real(*a))
    layer = Linear(40, 37, bias=True)
    with torch.no_grad():
        layer.weight.copy_(rand(37, 40, seed=6) * 0.2)
        layer.bias.copy_(rand(37, seed=7))
        x = rand(1, 40, seed=8)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and not calls  # fp32
        half = layer.half()
        out = half(x.half())
        assert calls == [one_row_rule(40, 37)]
        torch.testing.assert_close(out, F.linear(x.half().float(), half.weight.float(), half.bias.float()).half(),
                                   **TOL[torch.float16])  # fmt: skip
        assert torch.equal(half(x.half().repeat(3, 1)), F.linear(x.half().repeat(3, 1), half.weight, half.bias))
        half.fused_ops = False
        assert torch.equal(half(x.half()), F.linear(x.half(), half.weight, half.bias))
    assert len(calls) == 1
    half.fused_ops = True
    with torch.enable_grad():
        y = half(x.half())  # parameters require grad: F.linear, differentiable
        assert y.requires_grad and len(calls) == 1
    with torch.no_grad():
        xh = x.half()
        for args in [(xh.repeat(1, 2)[:, ::2], half.weight, half.bias),  # x columns strided
                     (xh, half.weight.t().contiguous().t(), half.bias),  # weight not contiguous
                     (xh, half.weight, torch.cat([half.bias, half.bias])[::2]),  # bias strided
                     (xh[None], half.weight, half.bias)]:  # 3-D x
            assert torch.equal(fused_ops.linear(*args), F.linear(*args))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fused_ops.linear(xh, half.weight, half.bias).dtype == F.linear(xh, half.weight, half.bias).dtype
    assert len(calls) == 1  # none of these took the kernel


def test_swiglu_down_projection_dispatch(monkeypatch):
    """GatedMLP / DFlashMLP: where the down projection takes the kernel, one launch reads gate and
    up (same bits as activation + GEMM); fp32 (cuBLAS) keeps the two ops, bit for bit as before."""

    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    calls = []
    real = fused_ops._kernels().skinny_linear
    monkeypatch.setattr(fused_ops._kernels(), "skinny_linear",
                        lambda *a, **kw: calls.append(kw.get("up") is not None) or real(*a, **kw))  # fmt: skip
    monkeypatch.setattr(fused_ops._kernels(), "skinny_fuses_swiglu", lambda rows, k, n: rows == 1 and (k, n) == (40, 24))
    mlp = _random_mlp(seed=15)
    with torch.no_grad():
        x = rand(1, 24, seed=17)
        two_ops = F.linear(silu_mul(*F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)), mlp.down_proj.weight)
        assert torch.equal(mlp(x), two_ops) and not calls  # fp32: activation kernel, then F.linear
        mlp.half()
        out = mlp(x.half())
        assert calls == [False, True]  # gate_up GEMM, then the gated down projection
        gate_up = fused_ops.linear(x.half(), mlp.gate_up_proj.weight, None)
        assert torch.equal(out, fused_ops.linear(silu_mul(*gate_up.chunk(2, dim=-1)), mlp.down_proj.weight, None))
        mlp.down_proj.fused_ops = False  # a projection off the kernels: the whole MLP on the torch twins
        calls.clear()
        gate_up = F.linear(x.half(), mlp.gate_up_proj.weight)
        assert torch.equal(mlp(x.half()), F.linear(fused_ops.silu_and_mul_ref(gate_up), mlp.down_proj.weight))
        assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_swiglu_gate_up_equals_the_gemm_then_the_activation_kernel(dtype, rows):
    """skinny_swiglu: silu(x W_gate^T) * (x W_up^T) in one launch == the dot GEMM of the stacked
    weight, then the activation kernel, bit for bit (same tiles: the same sums, the same
    roundings); == the torch twins within rounding. I = 37 leaves a partial column block, K = 40
    a partial K tile, x is strided."""
    x = rand(rows, 50, dtype=dtype, seed=21)[:, :40] * 2
    w = rand(74, 40, dtype=dtype, seed=22) * 0.3
    out = skinny_swiglu(x, w, DOT)
    assert out.shape == (rows, 37) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, silu_mul(*skinny_linear(x, w, None, DOT).chunk(2, dim=-1)))
    expected = fused_ops.silu_and_mul_ref(F.linear(x.float(), w.float()).to(dtype))
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_swiglu_gate_up_rows_depend_only_on_themselves():
    x, other, w = rand(16, 40, seed=23), rand(16, 40, seed=24), rand(74, 40, seed=25) * 0.3
    block = skinny_swiglu(x, w, DOT)
    for row in (0, 9, 15):
        mixed = other.clone()
        mixed[row] = x[row]
        assert torch.equal(skinny_swiglu(mixed, w, DOT)[row], block[row])


def test_swiglu_gate_up_refusals():
    x, w = rand(4, 8), rand(6, 8)
    with pytest.raises(ValueError, match="without split-K"):
        skinny_swiglu(x, w, DOT_SPLIT)
    with pytest.raises(ValueError, match="without split-K"):
        skinny_swiglu(x, w, ROW)
    with pytest.raises(ValueError, match="even number of rows"):
        skinny_swiglu(x, rand(7, 8), DOT)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_swiglu(rand(17, 8), w, DOT)
    with pytest.raises(ValueError, match="share one of"):
        skinny_swiglu(x.half(), w, DOT)
    with pytest.raises(ValueError, match="unit column stride"):
        skinny_swiglu(rand(8, 4).t(), w, DOT)
    with pytest.raises(ValueError, match=r"\[2 \* I, in\]"):
        skinny_swiglu(x, rand(6, 9), DOT)


def test_swiglu_config_choice():
    """2-16 rows of a gate_up shape with 16-row dot tiles (no split-K): those tiles at half the
    block width; one row (the down projection fuses the activation there), unlisted shapes, odd
    widths and other GPUs: None (two launches)."""
    from blockdraft.kernels import skinny_gemm

    gemm = config_for(16, 4096, 24576, CPU)  # Qwen3-8B gate_up (and its drafter's, stacked)
    assert swiglu_config_for(16, 4096, 24576, CPU) == gemm._replace(block_n=gemm.block_n // 2)
    assert swiglu_config_for(2, 896, 9728, CPU).block_n >= 16  # Qwen2.5-0.5B
    assert swiglu_config_for(1, 4096, 24576, CPU) is None and swiglu_config_for(17, 4096, 24576, CPU) is None
    assert swiglu_config_for(16, 100, 300, CPU) is None  # no 16-row tiles: cuBLAS GEMM + activation
    assert swiglu_config_for(16, 4864, 896, CPU) is None  # split-K tiles: not a gate_up kernel
    assert swiglu_config_for(16, 4096, 24577, CPU) is None
    assert skinny_gemm._swiglu_choice(4096, 24576) is not None
    cuda = torch.device("cuda", 0)
    try:
        skinny_gemm._is_sm90.cache_clear()
        import unittest.mock as mock

        with mock.patch.object(skinny_gemm, "_is_sm90", lambda index: False):
            assert swiglu_config_for(16, 4096, 24576, cuda) is None
    finally:
        skinny_gemm._is_sm90.cache_clear()


def test_gated_mlp_runs_gate_up_and_activation_in_one_launch_for_several_rows(monkeypatch):
    """GatedMLP with 2-16 rows and a listed shape: skinny_swiglu, then the down projection (two
    launches), equal bit for bit to the GEMM + activation + GEMM it replaces; one row keeps the
    one-row path; fp32 keeps F.linear."""
    from blockdraft.kernels import skinny_gemm

    monkeypatch.setattr(fused_ops, "_CPU_KERNELS", True)
    monkeypatch.setattr(skinny_gemm, "_SM90_SIXTEEN_ROWS", {(24, 80): DOT, (40, 24): DOT})
    skinny_gemm._choice.cache_clear()
    skinny_gemm._swiglu_choice.cache_clear()
    try:
        swiglus = []
        real = fused_ops._kernels().skinny_swiglu
        monkeypatch.setattr(fused_ops._kernels(), "skinny_swiglu", lambda *a: swiglus.append(a[2]) or real(*a))
        mlp = _random_mlp(seed=26)
        with torch.no_grad():
            x = rand(5, 24, seed=28)
            two_ops = F.linear(silu_mul(*F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)), mlp.down_proj.weight)
            assert torch.equal(mlp(x), two_ops) and not swiglus  # fp32: F.linear, activation kernel, F.linear
            mlp.half()
            xh = x.half()
            out = mlp(xh)
            assert swiglus == [DOT._replace(block_n=16)]
            gate_up = skinny_linear(xh, mlp.gate_up_proj.weight, None, DOT)
            assert torch.equal(out, skinny_linear(silu_mul(*gate_up.chunk(2, dim=-1)), mlp.down_proj.weight, None, DOT))
            mlp(xh[:1])
            assert len(swiglus) == 1  # one row: the gate_up GEMM and the (gated) down projection
    finally:
        skinny_gemm._choice.cache_clear()
        skinny_gemm._swiglu_choice.cache_clear()


def _random_mlp(seed: int):
    """A fp32 GatedMLP(24 -> 40 -> 24) with random weights (gate_up from `seed`, down from seed + 1)."""
    from blockdraft.layers.mlp import GatedMLP

    mlp = GatedMLP(24, 40)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(rand(80, 24, seed=seed) * 0.3)
        mlp.down_proj.weight.copy_(rand(24, 40, seed=seed + 1) * 0.2)
    return mlp
