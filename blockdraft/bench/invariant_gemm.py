"""Time the batch-invariant GEMM beside cuBLAS and the default path, per linear shape and row count.

The GEMM is `blockdraft.kernels.invariant_gemm` (--batch-invariant), on the GPU.

Cells are us per call, timed as `blockdraft.bench.skinny_gemm.time_calls` times them (CUDA-graph
replays over weight copies together >= 300 MB, so weights stream from HBM as in a model step).
Columns: cublas (F.linear), default (`fused_ops.linear`: the skinny kernels where chosen, else
cuBLAS), invariant (the tiles `config_for` picks); with --sweep, the fastest tiling of a grid
for each row count and the tiling with the least summed time over the row counts (what a table
entry must be: one tiling per shape for every row count). Each swept tiling is also checked for
invariance (four rows of a 300-row call the same bits as one-row calls); a tiling that fails is
reported and never picked; one that does not compile (shared memory) is recorded as an error.
Prints a table and writes JSON (`--out`).

    python -m blockdraft.bench.invariant_gemm --rows 1 16 192 2048 --out invariant_gemm.json
    python -m blockdraft.bench.invariant_gemm --sweep --out invariant_gemm_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from torch.nn import functional as F

from blockdraft.bench.skinny_gemm import SHAPES, time_calls
from blockdraft.errors import refuse_unwritable

LM_HEADS = {"qwen2.5-0.5b": 151936, "qwen3-8b": 151936, "qwen2.5-1.5b": 151936, "smollm2-135m": 49152}
# tilings (block_n, block_k, num_warps, num_stages, block_m) of --sweep
SWEEP = [(bn, bk, 4, ns, bm) for bm, bn, bk, ns in itertools.product((16, 64), (16, 32, 64), (128, 256), (3, 4))]


def _inputs(k: int, n: int, rows: int, min_bytes: int = 300_000_000):
    copies = max(1, -(-min_bytes // (k * n * 2)))
    g = torch.Generator("cuda").manual_seed(k * 31 + n)
    weights = [(torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16() for _ in range(copies)]
    xs = [torch.randn(rows, k, device="cuda", generator=g).bfloat16() for _ in range(copies)]
    return weights, xs


INVARIANCE_ROWS = 300  # rows of the call whose rows the one-row calls must reproduce


def _invariant(config, k: int, n: int) -> bool:
    """Rows 0, 5, 150 and 299 of a 300-row call are the same bits as one-row calls."""
    from blockdraft.kernels.invariant_gemm import invariant_linear

    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(INVARIANCE_ROWS, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16()
    full = invariant_linear(x, w, config=config)
    return all(torch.equal(invariant_linear(x[i:i + 1].contiguous(), w, config=config), full[i:i + 1])
               for i in (0, 5, INVARIANCE_ROWS // 2, INVARIANCE_ROWS - 1))  # fmt: skip


def bench_shape(k: int, n: int, rows_list: list[int], sweep: bool) -> dict:
    """One record for W [n, k] (bf16): us per call per row count for each column (module docstring)."""
    from blockdraft.kernels.invariant_gemm import InvariantConfig, _max_shared_memory, config_for, invariant_linear
    from blockdraft.layers.fused_ops import linear

    chosen = config_for(k, n, torch.bfloat16, _max_shared_memory(torch.device("cuda")))
    rec = {"k": k, "n": n, "chosen": list(chosen), "rows": {}}
    for rows in rows_list:
        weights, xs = _inputs(k, n, rows)
        rec["rows"][rows] = {
            "cublas": time_calls(lambda x, w: F.linear(x, w), weights, xs),
            "default": time_calls(lambda x, w: linear(x, w, None), weights, xs),
            "invariant": time_calls(lambda x, w: invariant_linear(x, w), weights, xs),
        }
        del weights, xs
    if sweep:
        tilings = {}
        for t in SWEEP:
            config = InvariantConfig(*t)
            try:
                ok = _invariant(config, k, n)
                times = {}
                for rows in rows_list:
                    weights, xs = _inputs(k, n, rows)
                    times[rows] = time_calls(lambda x, w, c=config: invariant_linear(x, w, config=c), weights, xs)
                    del weights, xs
            except Exception as e:  # out of shared memory / registers for this tiling
                tilings[str(t)] = {"error": type(e).__name__}
                continue
            tilings[str(t)] = {"invariant": ok, "us": times, "total": sum(times.values())}
        good = {t: r for t, r in tilings.items() if r.get("invariant")}
        rec["sweep"] = tilings
        rec["not_invariant"] = sorted(t for t, r in tilings.items() if r.get("invariant") is False)
        if good:
            rec["best_total"] = min(good, key=lambda t: good[t]["total"])
            rec["best_per_rows"] = {rows: min(good, key=lambda t: good[t]["us"][rows]) for rows in rows_list}
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockdraft.bench.invariant_gemm", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--models", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(SHAPES),
                   help="whose linear shapes (and LM head) to time (default qwen2.5-0.5b)")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 192, 2048],
                   help="row counts per shape, each >= 1 (default 1 16 192 2048: a decode row, a verify block, "
                        "32 verify blocks, a prefill chunk); repeats are timed once")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings (minutes per shape)")
    p.add_argument("--out", default=None, help="write every record here (JSON)")
    args = p.parse_args(argv)
    if min(args.rows) < 1:
        p.error(f"--rows must be >= 1, got {args.rows}")
    args.rows = sorted(set(args.rows))
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    refuse_unwritable(p, "--out", args.out)
    records = []
    print("| model | linear | K | N | rows | cublas us | default us | invariant us | chosen | best swept (total) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        linears = [(name, k, n) for name, k, n in SHAPES[model] if not name.startswith("draft")]
        linears.append(("lm_head", SHAPES[model][0][1], LM_HEADS[model]))
        for name, k, n in linears:
            rec = dict(model=model, linear=name, **bench_shape(k, n, args.rows, args.sweep))
            records.append(rec)
            for rows, t in rec["rows"].items():
                best = rec.get("best_total", "")
                if best:
                    best = f"{best} {rec['sweep'][best]['us'][rows]:.2f}"
                print(f"| {model} | {name} | {k} | {n} | {rows} | {t['cublas']:.2f} | {t['default']:.2f} | "
                      f"{t['invariant']:.2f} | {tuple(rec['chosen'])} | {best} |", flush=True)
            if rec.get("not_invariant"):
                print(f"  not invariant: {rec['not_invariant']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
