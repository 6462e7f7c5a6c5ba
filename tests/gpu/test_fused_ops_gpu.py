"""Compiled fused-op Triton kernels == their torch twins on CUDA, fp32 and bf16, at real shapes.

Shapes: Qwen3-8B (hidden 4096, 32 / 8 heads x 128 with q/k norm, MLP 12288) and Qwen2.5-0.5B
(hidden 896, 14 / 2 heads x 64, MLP 4864); q / k are strided views of a fused qkv output.
Tolerances: RoPE alone is bit-identical; otherwise fp32 within float noise, and bf16 within
2 ulps with at most 1% of elements differing at all (the kernels' rsqrt / exp may differ from
torch's in the last fp32 bit, which flips a bf16 rounding now and then; the product with the
weight can turn 1 ulp into 2). Norm + RoPE in bf16: within 2 ulps of the rotated pair's magnitude
(x * cos - y * sin cancels: the twin rounds the normed x, y and both products to bf16, so an
output much smaller than its pair can differ by more ulps of itself; a run with unseeded
positions once hit 4).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 would run the kernels in the interpreter", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.kernels.activation import silu_and_mul, silu_mul  # noqa: E402
from blockdraft.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from blockdraft.kernels.rope import norm_rope, qk_norm_rope  # noqa: E402
from blockdraft.layers import fused_ops  # noqa: E402
from blockdraft.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.layers.fused_cases import ulp_distance  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
ROWS = [1, 7, 257]
# (hidden, heads, kv_heads, head_dim, intermediate, qk_norm)
QWEN3_8B = (4096, 32, 8, 128, 12288, True)
QWEN25_05B = (896, 14, 2, 64, 4864, False)
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen2.5-0.5b": QWEN25_05B}


def assert_kernel_matches(out: torch.Tensor, ref: torch.Tensor, exact: bool = False, max_ulp: int = 2) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if exact:
        assert torch.equal(out, ref)
        return
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    ulps = ulp_distance(out, ref)
    assert int(ulps.max()) <= max_ulp, f"max {int(ulps.max())} ulps"
    assert float((ulps > 0).float().mean()) <= 0.01, f"{float((ulps > 0).float().mean()):.2%} of elements differ"


def assert_rotated_matches(out: torch.Tensor, ref: torch.Tensor, max_ulp: int = 2) -> None:
    """bf16 RoPE outputs [rows, heads, head_dim] (halves rotated together, as apply_rotary): each
    element within max_ulp ulps of its pair's magnitude sqrt(a^2 + b^2), which the rotation keeps;
    at most 1% of elements differ at all. Other dtypes: as assert_kernel_matches."""
    if out.dtype != torch.bfloat16:
        assert_kernel_matches(out, ref)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape
    r = ref.float()
    half = r.shape[-1] // 2
    pair = torch.sqrt(r[..., :half] ** 2 + r[..., half:] ** 2)
    pair = torch.cat([pair, pair], dim=-1).clamp_min(torch.finfo(torch.bfloat16).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(pair)) - 7)  # bf16: 8 significant bits
    err = (out.float() - r).abs()
    assert bool((err <= max_ulp * ulp).all()), f"max {float((err / ulp).max()):.1f} ulps of the pair's magnitude"
    diff = float((ulp_distance(out, ref) > 0).float().mean())
    assert diff <= 0.01, f"{diff:.2%} of elements differ"


def rand(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_fused_add(dtype, shape, rows):
    hidden = SHAPES[shape][0]
    x, r = rand(rows, hidden, dtype=dtype, scale=2), rand(rows, hidden, dtype=dtype, scale=8, seed=1)
    w = rand(hidden, dtype=dtype, seed=2) * 0.2 + 1
    assert_kernel_matches(rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6))
    normed, residual = fused_add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_residual = fused_ops.add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(residual, ref_residual)
    assert_kernel_matches(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm_rope"])
def test_qk_norm_rope_on_qkv_views(dtype, shape, rows, with_norm):
    _, heads, kv_heads, head_dim, _, _ = SHAPES[shape]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = rand(rows, q_size + 2 * kv_size, dtype=dtype, scale=2)
    q = qkv[:, :q_size].view(rows, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(rows, kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 1e6).cuda()
    # Seeded: the inputs must not depend on what else ran in the worker (xdist).
    positions = torch.randint(0, 32768, (rows,), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    cos, sin = rope.cos_sin(positions, dtype)
    qw, kw = (rand(head_dim, dtype=dtype, seed=s) * 0.2 + 1 for s in (3, 4)) if with_norm else (None, None)
    out_q, out_k = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    ref_q, ref_k = fused_ops.qk_norm_rope_ref(q, k, cos, sin, qw, kw, 1e-6)
    out_single = norm_rope(k, cos, sin, kw, 1e-6)
    if not with_norm:
        # Every op is one rounded product or sum as in torch (the kernel is compiled without FMA
        # contraction): bit-identical in both dtypes.
        for out, ref in ((out_q, ref_q), (out_k, ref_k), (out_single, ref_k)):
            assert_kernel_matches(out, ref, exact=True)
        return
    for out, ref in ((out_q, ref_q), (out_k, ref_k), (out_single, ref_k)):
        assert_rotated_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm_rope"])
def test_qk_norm_rope_writes_the_kv_cache_like_write_kv(dtype, shape, with_norm):
    """kv_write: the RoPE launch leaves the paged cache exactly as write_kv_triton(k_out, v)
    would (padding slots untouched), and q / k are unchanged by it."""
    from blockdraft.attention.triton_attention import write_kv_triton

    _, heads, kv_heads, head_dim, _, _ = SHAPES[shape]
    rows, q_size, kv_size = 16, heads * head_dim, kv_heads * head_dim
    qkv = rand(rows, q_size + 2 * kv_size, dtype=dtype, scale=2)
    q, k, v = (t.view(rows, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    rope = RotaryEmbedding(head_dim, 1e6).cuda()
    cos, sin = rope.cos_sin(torch.randint(0, 32768, (rows,), device="cuda"), dtype)
    qw, kw = (rand(head_dim, dtype=dtype, seed=s) * 0.2 + 1 for s in (3, 4)) if with_norm else (None, None)
    slots = torch.randperm(64, device="cuda")[:rows]
    slots[3] = -1
    caches = [rand(4, 16, kv_heads, head_dim, dtype=dtype, seed=s) for s in (5, 6)]
    expected = [c.clone() for c in caches]
    out_q, out_k = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, kv_write=(v, *caches, slots))
    plain_q, plain_k = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    assert torch.equal(out_q, plain_q) and torch.equal(out_k, plain_k)
    write_kv_triton(*expected, plain_k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    # norm_rope with kv_write (the drafter's context rows: k alone; its launch may round the fp32
    # norm differently from the q + k launch) leaves the cache as write_kv_triton(norm_rope(k), v)
    k_caches = [rand(4, 16, kv_heads, head_dim, dtype=dtype, seed=s) for s in (5, 6)]
    expected = [c.clone() for c in k_caches]
    alone = norm_rope(k, cos, sin, kw, 1e-6)
    assert torch.equal(norm_rope(k, cos, sin, kw, 1e-6, kv_write=(v, *k_caches, slots)), alone)
    write_kv_triton(*expected, alone, v, slots)
    assert torch.equal(k_caches[0], expected[0]) and torch.equal(k_caches[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(dtype, shape, rows):
    inter = SHAPES[shape][4]
    gate_up = rand(rows, 2 * inter, dtype=dtype, scale=3)
    assert_kernel_matches(silu_and_mul(gate_up), fused_ops.silu_and_mul_ref(gate_up), max_ulp=2)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    assert_kernel_matches(silu_mul(gate, up), fused_ops.silu_mul_ref(gate, up), max_ulp=2)


def test_layers_dispatch_cuda_inputs_to_the_kernels(monkeypatch):
    calls = []
    real = fused_ops._kernels()
    spy = type(real)(**{name: _recorder(name, fn, calls) for name, fn in vars(real).items()})
    monkeypatch.setattr(fused_ops, "_kernels", lambda: spy)
    x = rand(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        fused_ops.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)
        fused_ops.silu_and_mul(x)
        fused_ops.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6, fused=False)
    assert calls == ["rms_norm", "silu_and_mul"]


def _recorder(name, fn, calls):
    def record(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return record


SKINNY_SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896), (4096, 6144), (12288, 4096), (4096, 32768)]


@pytest.mark.parametrize("k,n", SKINNY_SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_skinny_linear_at_real_shapes(k, n, rows):
    """The kernel `config_for` picks for the shape (1 row: the row kernel or a dot entry; 5 and
    16 rows: the 16-row entry; where it has none, or off sm90, a fixed dot config) == F.linear
    within bf16 rounding; a graph replay follows new inputs copied into the captured ones; a row
    gives the same bits alone as inside the block."""
    from blockdraft.kernels.skinny_gemm import SkinnyConfig, config_for, skinny_linear

    config = config_for(rows, k, n, torch.device("cuda")) or SkinnyConfig("dot", 32, 256, 4, 4)
    x, w = rand(rows, k, dtype=torch.bfloat16), rand(n, k, dtype=torch.bfloat16, scale=0.02, seed=1)
    bias = rand(n, dtype=torch.bfloat16, seed=2)
    out = skinny_linear(x, w, bias, config)
    exact = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)
    # within one bf16 rounding of the exact result, like cuBLAS
    cublas_err = (torch.nn.functional.linear(x, w, bias).float() - exact).abs().max()
    assert (out.float() - exact).abs().max() <= 2 * cublas_err + 1e-3
    static_x = torch.zeros_like(x)
    skinny_linear(static_x, w, bias, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = skinny_linear(static_x, w, bias, config)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(graph_out, out)
    assert torch.equal(skinny_linear(x[-1:], w, bias, config)[0], out[-1])


@pytest.mark.parametrize("k,n", [(4864, 896), (896, 1152), (12288, 4096)])
@pytest.mark.parametrize("split", [2, 4, 8])
def test_skinny_split_k(k, n, split):
    """The dot kernel split over K (the last program of a column block adds the partials) ==
    F.linear within bf16 rounding, bit-identical over 20 launches and 20 graph replays (the
    order of the additions does not depend on which program finishes last), counters at zero."""
    from blockdraft.kernels import skinny_gemm

    config = skinny_gemm.SkinnyConfig("dot", 32, 128, 4, 3, split)
    x, w = rand(16, k, dtype=torch.bfloat16), rand(n, k, dtype=torch.bfloat16, scale=0.02, seed=1)
    out = skinny_gemm.skinny_linear(x, w, None, config)
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(x.float(), w.float()), atol=1e-2, rtol=1e-2)
    for _ in range(20):
        assert torch.equal(skinny_gemm.skinny_linear(x, w, None, config), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = skinny_gemm.skinny_linear(x, w, None, config)
    for _ in range(20):
        graph.replay()
        assert torch.equal(graph_out, out)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in skinny_gemm._SPLIT_COUNTERS.values())


@pytest.mark.parametrize("k,n", [(4864, 896), (12288, 4096), (1024, 896)])
@pytest.mark.parametrize("rows", [1, 16])
def test_skinny_swiglu_down_projection(k, n, rows):
    """The down projection reading gate and up itself (silu(gate) * up formed in the GEMM) ==
    the activation kernel then the same GEMM, bit for bit, eagerly and in a graph replay."""
    from blockdraft.kernels.activation import silu_mul
    from blockdraft.kernels.skinny_gemm import SkinnyConfig, config_for, skinny_linear

    config = config_for(rows, k, n, torch.device("cuda")) or SkinnyConfig("dot", 32, 256, 4, 4)
    gate_up, w = rand(rows, 2 * k, dtype=torch.bfloat16), rand(n, k, dtype=torch.bfloat16, scale=0.02, seed=1)
    gate, up = gate_up[:, :k], gate_up[:, k:]
    out = skinny_linear(gate, w, None, config, up=up)
    assert torch.equal(out, skinny_linear(silu_mul(gate, up), w, None, config))
    static = torch.zeros_like(gate_up)
    skinny_linear(static[:, :k], w, None, config, up=static[:, k:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = skinny_linear(static[:, :k], w, None, config, up=static[:, k:])
    static.copy_(gate_up)
    graph.replay()
    assert torch.equal(graph_out, out)


@pytest.mark.parametrize("k,n2", [(896, 9728), (4096, 24576), (896, 2048), (1536, 17920)])
@pytest.mark.parametrize("rows", [2, 16])
def test_skinny_swiglu_gate_up(k, n2, rows):
    """The gate/up projection with the activation in its launch (`skinny_swiglu`, the tiles
    `swiglu_config_for` picks, else a fixed dot config) == the activation kernel after F.linear
    within bf16 rounding; == the activation after the dot GEMM with the same block_k (the same
    sums) bit for bit; a graph replay follows new inputs; a row gives the same bits alone."""
    from blockdraft.kernels.activation import silu_and_mul
    from blockdraft.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_swiglu, swiglu_config_for

    config = swiglu_config_for(rows, k, n2, torch.device("cuda")) or SkinnyConfig("dot", 32, 128, 4, 4)
    x, w = rand(rows, k, dtype=torch.bfloat16), rand(n2, k, dtype=torch.bfloat16, scale=0.05, seed=1)
    out = skinny_swiglu(x, w, config)
    exact = fused_ops.silu_and_mul_ref(torch.nn.functional.linear(x.float(), w.float()))
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)
    two_launches = silu_and_mul(skinny_linear(x, w, None, config))
    mismatched = (out != two_launches).sum().item()
    assert mismatched == 0, f"{mismatched} of {out.numel()} values differ from GEMM + activation with the same tiles"
    static_x = torch.zeros_like(x)
    skinny_swiglu(static_x, w, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = skinny_swiglu(static_x, w, config)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(graph_out, out)
    assert torch.equal(skinny_swiglu(x[-1:], w, config)[0], out[-1])


def test_linear_layers_take_the_skinny_kernel_on_sm90(monkeypatch):
    from blockdraft.kernels import skinny_gemm
    from blockdraft.layers.linear import Linear

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the skinny-GEMM tables are for sm90")
    calls = []
    real = fused_ops._kernels().skinny_linear
    monkeypatch.setattr(fused_ops._kernels(), "skinny_linear", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    layer = Linear(896, 1152, bias=True).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        layer(rand(1, 896, dtype=torch.bfloat16))
        layer(rand(16, 896, dtype=torch.bfloat16))
        layer(rand(17, 896, dtype=torch.bfloat16))  # cuBLAS
    assert calls == [skinny_gemm.config_for(1, 896, 1152, torch.device("cuda")),
                     skinny_gemm.config_for(16, 896, 1152, torch.device("cuda"))]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rotary_table_gathers_the_angles_bit_for_bit(dtype):
    """CUDA cos_sin gathers from the table (2 launches): == the per-call float32 angles bit for
    bit, also in a graph replay with new positions; positions past the table read its last row;
    a first call inside a capture computes the angles (no table is recorded into the graph)."""
    from blockdraft.layers.rotary import TABLE_MARGIN

    rope = RotaryEmbedding(128, 1e6, max_positions=40960).cuda()
    positions = torch.tensor([0, 1, 17, 4095, 40959, 40960 + 15, 123, 123], device="cuda")
    cos, sin = rope.cos_sin(positions, dtype)
    ref_cos, ref_sin = rope._angles_cos_sin(positions, dtype)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin) and rope._tables
    last = torch.tensor([40960 + TABLE_MARGIN - 1], device="cuda")
    far = rope.cos_sin(torch.tensor([10**6], device="cuda"), dtype)
    assert torch.equal(far[0], rope._angles_cos_sin(last, dtype)[0])
    static = positions.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cos, graph_sin = rope.cos_sin(static, dtype)
    static.copy_(positions.flip(0) + 5)
    graph.replay()
    ref_cos, ref_sin = rope._angles_cos_sin(static, dtype)
    assert torch.equal(graph_cos, ref_cos) and torch.equal(graph_sin, ref_sin)
    fresh = RotaryEmbedding(128, 1e6, max_positions=40960).cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fresh.cos_sin(static, dtype)
    assert not fresh._tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows, vocab", [(1, 151936), (16, 151936), (15, 32768), (512, 151936), (3, 49152), (2, 5)])
def test_argmax_rows_equals_torch(dtype, rows, vocab):
    """The two-launch row argmax == torch.argmax at vocabulary widths, with planted ties across
    and inside pieces, +inf and NaN rows; also captured in a graph and replayed on new logits."""
    from blockdraft.kernels.argmax import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, device="cuda", generator=g).to(dtype)
    if vocab > 5000:
        top = x.max() + 1
        x[0, [vocab - 1, 4097, 4095]] = top  # a tie across pieces: 4095 wins
        x[-1, [1, 2]] = float("inf") if rows > 1 else top
        if rows > 2:
            x[1, [vocab // 2, 7]] = float("nan")
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(x, out=out)
    x.copy_(torch.randn(rows, vocab, device="cuda", generator=g).to(dtype))
    graph.replay()
    assert torch.equal(out, torch.argmax(x, dim=-1))


def test_embedding_indexing_equals_f_embedding():
    """VocabEmbedding on CUDA indexes the table: == F.embedding bit for bit, 1-512 ids, repeats."""
    from torch.nn import functional as F

    from blockdraft.layers.embedding import VocabEmbedding

    emb = VocabEmbedding(151936, 4096).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(emb.weight)
    for n in (1, 16, 17, 512):
        ids = torch.randint(0, 151936, (n,), device="cuda")
        ids[0] = ids[-1]
        with torch.no_grad():
            assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
