"""Micro-benchmark of x [rows, K] @ W [N, K].T on the GPU: cuBLAS (`F.linear`) vs the skinny-GEMM
kernels (`blockdraft.kernels.skinny_gemm`), per linear shape of the models we serve.

Every cell is the mean time of one call inside a CUDA graph that multiplies by `copies`
different weight matrices in turn (together >= 300 MB, so weights stream from HBM as in a model
step instead of sitting in the 50 MB L2), the median of 5 timings of 20 replays. Columns:
  cublas    F.linear (what the layer ran before),
  chosen    the tiles `config_for` picks (the shipped table, or the one-row rule),
  best      with --sweep: the fastest of a grid of tilings (row kernel for one row, dot kernel
            with and without split-K for any row count), which is how the shipped table was
            found (minutes per shape),
  floor     the weight bytes at 4.25 TB/s (the H200's measured copy bandwidth).
  swiglu    for SwiGLU down projections (down, draft_down) where a kernel is chosen: the activation
            kernel then the chosen GEMM (two launches) -> the GEMM reading gate and up itself
            (`skinny_linear(gate, W, None, config, up=up)`, one launch); for stacked gate_up
            projections at 2-16 rows: the chosen GEMM (or cuBLAS) then the activation kernel ->
            `skinny_swiglu` (one launch) with the tiles `swiglu_config_for` picks, and the same
            tiles at each of SWIGLU_BLOCK_N's block widths (`gate_up_swiglu` in the JSON).
Prints a table and writes JSON (`--out`).

    python -m blockdraft.bench.skinny_gemm --out skinny_gemm.json            # the default shapes
    python -m blockdraft.bench.skinny_gemm --sweep --rows 1 16 --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
from torch.nn import functional as F

from blockdraft.errors import refuse_unwritable

# (name, in_features K, out_features N) of the linear layers of each shape.
SHAPES = {
    "qwen2.5-0.5b": [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896),
                     ("draft_kv", 896, 128), ("draft_gate", 896, 1024), ("draft_down", 1024, 896),
                     ("draft_fc_3", 2688, 896), ("draft_head_32k", 896, 32768),
                     ("draft_gate_up", 896, 2048), ("draft_ctx_kv", 896, 256)],
    "qwen3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096),
                 ("draft_kv", 4096, 1024), ("draft_gate", 4096, 12288), ("draft_fc_5", 20480, 4096),
                 ("draft_head_32k", 4096, 32768), ("draft_ctx_kv", 4096, 2048)],
    "qwen2.5-1.5b": [("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536)],
    "smollm2-135m": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)],
}  # fmt: skip
HBM_BYTES_PER_S = 4.25e12
SWIGLU_DOWN = ("down", "draft_down")  # linears whose input is silu(gate) * up
# stacked gate_up linears (a stacked drafter's draft_gate_up; the 8B drafter's is the target's shape)
SWIGLU_GATE_UP = ("gate_up", "draft_gate_up")
SWIGLU_BLOCK_N = (16, 32, 64)  # block widths (per half) timed for the one-launch gate/up + activation
SWEEP_ROW = [("row", bn, bk, nw, ns) for bn, bk, nw, ns in
             itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3, 4))]  # fmt: skip
SWEEP_DOT = [("dot", bn, bk, nw, ns) for bn, bk, nw, ns in
             itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4, 5))]  # fmt: skip
# split-K tiles for narrow outputs (e.g. a down projection to 896 features: 28 column blocks of 32)
SWEEP_SPLIT = [("dot", bn, bk, 4, ns, split) for bn, bk, ns, split in
               itertools.product((16, 32, 64), (64, 128, 256), (3, 4), (2, 4, 8))]  # fmt: skip


def time_calls(fn, weights: list[torch.Tensor], xs: list[torch.Tensor], replays: int = 20) -> float:
    """us per fn(x, w) call: one CUDA graph calls fn on every (x, w) pair in turn; the median of 5
    timings of `replays` replays, divided by the calls."""
    for x, w in zip(xs, weights):
        fn(x, w)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for x, w in zip(xs, weights):
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * len(weights)))
    return statistics.median(times)


def bench_shape(k: int, n: int, rows: int, dtype: torch.dtype, sweep: bool, min_bytes: int = 300_000_000,
                swiglu: bool = False, gate_up: bool = False) -> dict:
    """One record for x [rows, k] @ W [n, k].T on CUDA: weight MB, HBM floor, cuBLAS and the chosen
    config in us per call, and with `sweep` the best tiling and the top 5 (configs that do not fit
    the GPU's shared memory are skipped). Weight copies fill >= min_bytes (bytes). `swiglu` (a
    down projection) with a chosen config: also `two_launch_swiglu_us` (activation kernel, then
    the GEMM) and `fused_swiglu_us` (the GEMM reading gate and up), checked equal bit for bit.
    `gate_up` (a stacked gate_up weight, 2-16 rows): also `gate_up_swiglu`, see `time_gate_up_swiglu`.

    Raises:
        AssertionError: a kernel's output disagrees with F.linear (allclose 2e-2).
    """
    from triton.runtime.errors import OutOfResources

    from blockdraft.kernels.skinny_gemm import SkinnyConfig, config_for, skinny_linear

    nbytes = k * n * torch.finfo(dtype).bits // 8
    copies = max(4, -(-min_bytes // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.02 for _ in range(copies)]
    xs = [torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen) for _ in range(copies)]
    reference = F.linear(xs[0].float(), weights[0].float())
    rec = dict(K=k, N=n, rows=rows, weight_mb=nbytes / 1e6, floor_us=nbytes / HBM_BYTES_PER_S * 1e6)
    rec["cublas_us"] = time_calls(lambda x, w: F.linear(x, w), weights, xs)

    def timed(config: SkinnyConfig) -> float | None:
        out = skinny_linear(xs[0], weights[0], None, config)
        if not torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"{config} disagrees with F.linear at K={k} N={n} rows={rows}")
        return time_calls(lambda x, w: skinny_linear(x, w, None, config), weights, xs)

    chosen = config_for(rows, k, n, torch.device("cuda"))
    rec["chosen"] = None if chosen is None else list(chosen)
    rec["chosen_us"] = None if chosen is None else timed(chosen)
    if swiglu and chosen is not None:
        from blockdraft.kernels.activation import silu_mul

        gate_ups = [torch.randn(rows, 2 * k, device="cuda", dtype=dtype, generator=gen) for _ in range(copies)]
        two = lambda gu, w: skinny_linear(silu_mul(gu[:, :k], gu[:, k:]), w, None, chosen)  # noqa: E731
        one = lambda gu, w: skinny_linear(gu[:, :k], w, None, chosen, up=gu[:, k:])  # noqa: E731
        if not torch.equal(one(gate_ups[0], weights[0]), two(gate_ups[0], weights[0])):
            raise AssertionError(f"the fused SwiGLU GEMM differs from activation + GEMM at K={k} N={n} rows={rows}")
        rec["two_launch_swiglu_us"] = time_calls(two, weights, gate_ups)
        rec["fused_swiglu_us"] = time_calls(one, weights, gate_ups)
    if gate_up and rows > 1:
        rec["gate_up_swiglu"] = time_gate_up_swiglu(weights, xs, chosen)
    if sweep:
        grid = (SWEEP_ROW if rows == 1 else []) + SWEEP_DOT + SWEEP_SPLIT
        results = []
        for c in grid:
            try:
                results.append((timed(SkinnyConfig(*c)), c))
            except OutOfResources:  # tiles too large for shared memory / registers: not a candidate
                continue
        results.sort()
        rec["best"], rec["best_us"] = list(results[0][1]), results[0][0]
        rec["top5"] = [[round(t, 3), list(c)] for t, c in results[:5]]
    return rec


def time_gate_up_swiglu(weights: list[torch.Tensor], xs: list[torch.Tensor], gemm) -> dict:
    """us per call of a stacked gate_up projection + SwiGLU activation: `two_launch_us` (the GEMM
    `gemm` picks, or cuBLAS where None, then the activation kernel), `one_launch_us` with the tiles
    `swiglu_config_for` picks (None where it picks none) and `by_block_n` {block_n: us} for those
    tiles (or a dot default) at each of SWIGLU_BLOCK_N's widths; `one_launch_equal`: whether the
    chosen one-launch output equals the two launches with the same tiles bit for bit.

    Raises:
        AssertionError: a one-launch output disagrees with F.linear + activation (allclose 2e-2).
    """
    from blockdraft.kernels.activation import silu_and_mul
    from blockdraft.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_swiglu, swiglu_config_for

    rows, k = xs[0].shape
    gemm_fn = (lambda x, w: F.linear(x, w)) if gemm is None else (lambda x, w: skinny_linear(x, w, None, gemm))
    reference = silu_and_mul(F.linear(xs[0].float(), weights[0].float()).to(xs[0].dtype)).float()
    rec: dict = {"two_launch_us": time_calls(lambda x, w: silu_and_mul(gemm_fn(x, w)), weights, xs)}
    chosen = swiglu_config_for(rows, k, weights[0].shape[0], torch.device("cuda"))
    rec["chosen"] = None if chosen is None else list(chosen)

    def timed(config: SkinnyConfig) -> float:
        out = skinny_swiglu(xs[0], weights[0], config)
        if not torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"skinny_swiglu {config} disagrees with F.linear + activation at {tuple(weights[0].shape)}")
        return time_calls(lambda x, w: skinny_swiglu(x, w, config), weights, xs)

    rec["one_launch_us"] = None if chosen is None else timed(chosen)
    if chosen is not None:
        same = silu_and_mul(skinny_linear(xs[0], weights[0], None, chosen))
        rec["one_launch_equal"] = bool(torch.equal(skinny_swiglu(xs[0], weights[0], chosen), same))
    base = chosen or SkinnyConfig("dot", 32, 128, 4, 4)
    rec["by_block_n"] = {bn: timed(base._replace(block_n=bn)) for bn in SWIGLU_BLOCK_N}
    return rec


def format_row(model: str, name: str, rec: dict) -> str:
    """One table line of a `bench_shape` record: shape, weight MB, floor / cuBLAS / chosen us per
    call and the gain (cuBLAS / chosen, "-" where cuBLAS is kept), plus the sweep's best and the
    SwiGLU down projection's two launches -> one."""

    def us(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    ratio = "-" if rec["chosen_us"] is None else f"{rec['cublas_us'] / rec['chosen_us']:.2f}x"
    best = f" | best {us(rec.get('best_us'))} {rec.get('best')}" if "best" in rec else ""
    if "fused_swiglu_us" in rec:
        best += f" | swiglu {us(rec['two_launch_swiglu_us'])} -> {us(rec['fused_swiglu_us'])}"
    if "gate_up_swiglu" in rec:
        g = rec["gate_up_swiglu"]
        widths = " ".join(f"{bn}:{us(t)}" for bn, t in g["by_block_n"].items())
        best += f" | gate_up+act {us(g['two_launch_us'])} -> {us(g['one_launch_us'])} (block_n {widths})"
    return (f"{model:13} {name:18} {rec['K']:>6} {rec['N']:>6} {rec['rows']:>4} {rec['weight_mb']:>8.1f} "
            f"{us(rec['floor_us']):>7} {us(rec['cublas_us']):>7} {us(rec['chosen_us']):>7} {ratio:>6}{best}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                   help="model shapes to time (default: all)")
    linears = sorted({name for shapes in SHAPES.values() for name, _, _ in shapes})
    p.add_argument("--linears", nargs="+", default=None, metavar="NAME",
                   help=f"only these linears of each model (default all; names: {', '.join(linears)})")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows of x (1-16; default 1 16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="default bfloat16")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings per shape (minutes)")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args(argv)
    if any(not 1 <= r <= 16 for r in args.rows):
        p.error(f"--rows must be in [1, 16], got {args.rows}")
    known = {name for model in args.models for name, _, _ in SHAPES[model]}
    if args.linears and not set(args.linears) <= known:
        p.error(f"--linears {sorted(set(args.linears) - known)} not among {sorted(known)} of {args.models}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernels and cuBLAS are timed as CUDA-graph replays)")
    if args.out:
        refuse_unwritable(p, "--out", args.out)
    dtype = getattr(torch, args.dtype)
    print(f"{'model':13} {'linear':18} {'K':>6} {'N':>6} {'rows':>4} {'MB':>8} {'floor':>7} {'cublas':>7} "
          f"{'chosen':>7} {'gain':>6}  (us per call, {torch.cuda.get_device_name()})")  # fmt: skip
    records = []
    for model in args.models:
        for (name, k, n), rows in itertools.product(SHAPES[model], args.rows):
            if args.linears and name not in args.linears:
                continue
            rec = dict(model=model, linear=name,
                       **bench_shape(k, n, rows, dtype, args.sweep, swiglu=name in SWIGLU_DOWN,
                                     gate_up=name in SWIGLU_GATE_UP))
            records.append(rec)
            print(format_row(model, name, rec), flush=True)
            if args.out:  # after every record, so a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(dict(schema="blockdraft-skinny-gemm/1", device=torch.cuda.get_device_name(),
                                   dtype=args.dtype, records=records), f, indent=1)  # fmt: skip
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
