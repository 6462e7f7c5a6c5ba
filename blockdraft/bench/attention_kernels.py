"""Micro-benchmark of the paged-attention backends: torch_ref vs the dense twin vs Triton.

Scenarios per model shape and batch size (every request has `ctx` cached tokens):
  decode  1 row per request (the row's K/V written, then attention over ctx keys),
  verify  16 rows per request (anchor + 15 drafts, causal),
  draft   a DFlash draft block of 16 uncached rows over ctx cached tokens (bidirectional).
Times: torch_ref and the dense twin are medians of `triton.testing.do_bench` on CUDA (of repeated
wall-clock calls on CPU); the Triton columns are CUDA-graph replays of 20 calls (mean of 10
replays / 20), the kernels' own time as inside the engine's graphs (do_bench of one eager call
measures the host's ~40 us of launch work for these 5-30 us kernels);
`max_err` is the largest |Triton - torch_ref| of the output over both Triton kernels, a sanity
check. The dense twin gathers every row's pages, so it is skipped where that would exceed
--dense-max-gib. Triton columns (CUDA only):
  triton    the kernel `paged_attention_triton` picks from the shapes (decode: single-row;
            verify / draft: multi-row),
  multi     the multi-row kernel forced (one program per query tile of a request x KV head),
  1row      the single-row kernel forced (one program per query row x KV head, the old path),
e.g. the verify row at ctx 1024, batch 32 (512 rows, Qwen3-8B) compares multi vs 1row.
--variants adds forced configurations (M of the multi-row tile, KV splits) per record.

    python -m blockdraft.bench.attention_kernels --out attention_kernels.json
    python -m blockdraft.bench.attention_kernels --device cpu --tiny --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from typing import Callable

import torch

from blockdraft.attention.dense_ref import paged_attention_dense
from blockdraft.attention.metadata import AttentionMetadata, build_metadata
from blockdraft.attention.torch_ref import paged_attention
from blockdraft.errors import refuse_unwritable

# name -> (num_heads, num_kv_heads, head_dim)
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen3-8b": (32, 8, 128)}
TINY_SHAPES = {"tiny": (4, 2, 16)}
SCENARIO_ROWS = {"decode": 1, "verify": 16, "draft": 16}
# Triton record column -> multi_row argument (None = the kernel picks from the shapes).
TRITON_PATHS = {"triton": None, "triton_multi": True, "triton_1row": False}
KV_BLOCK_SIZE = 16


def make_batch(
    scenario: str, batch: int, ctx: int, shape: tuple[int, int, int], dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
    """(q, k, v, k_cache, v_cache) and metadata of `batch` requests with `ctx` cached tokens each."""
    heads, kv_heads, dim = shape
    rows = SCENARIO_ROWS[scenario]
    block = rows if scenario == "draft" else 0
    seq_len = ctx if block else ctx + rows
    pages_per_req = -(-(ctx + rows) // KV_BLOCK_SIZE)
    pages = list(range(batch * pages_per_req))
    random.Random(seed).shuffle(pages)  # scattered pages, as after many allocations
    tables = [pages[i * pages_per_req : (i + 1) * pages_per_req] for i in range(batch)]
    meta = build_metadata(
        [seq_len] * batch, [rows] * batch, tables, KV_BLOCK_SIZE, num_block_tokens=block, device=device
    )
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    t = batch * rows
    cache_shape = (len(pages), KV_BLOCK_SIZE, kv_heads, dim)
    return (randn(t, heads, dim), randn(t, kv_heads, dim), randn(t, kv_heads, dim),
            randn(*cache_shape), randn(*cache_shape)), meta  # fmt: skip


def dense_bytes(tensors: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> int:
    """Rough peak bytes of the dense twin: gathered K and V in the cache dtype and in float32."""
    q, _, _, k_cache, _ = tensors
    keys = q.shape[0] * meta.block_table.shape[1] * k_cache.shape[1] * k_cache.shape[2] * k_cache.shape[3]
    return 2 * keys * (k_cache.element_size() + 4)


def median_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of fn() (do_bench on CUDA, wall clock on CPU)."""
    if device.startswith("cuda"):
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_replay_ms(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Mean milliseconds per call of fn() captured `calls` times in one CUDA graph, over
    `replays` replays (CUDA only; fn must be capture-safe: no host syncs)."""
    from blockdraft.bench.layer_ops import capture, time_ms

    graph = capture(lambda: [fn() for _ in range(calls)])
    return time_ms(graph.replay, iters=replays, warmup=1) / calls


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark every (shape, scenario, ctx, batch); returns one record per combination."""
    device, dtype = args.device, getattr(torch, args.dtype)
    use_triton = device.startswith("cuda")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    records = []
    for name, shape in shapes.items():
        for scenario in args.scenarios:
            for ctx in args.ctx:
                for batch in args.batch:
                    tensors, meta = make_batch(scenario, batch, ctx, shape, dtype, device)
                    scale = shape[2] ** -0.5

                    def call(backend, tensors=tensors, meta=meta, scale=scale):
                        return lambda: backend(*tensors, meta, scale, causal=scenario != "draft")

                    rec = {"model": name, "scenario": scenario, "ctx": ctx, "batch": batch, "rows": tensors[0].shape[0]}
                    rec["torch_ref_ms"] = median_ms(call(paged_attention), device, args.reps)
                    fits = dense_bytes(tensors, meta) <= args.dense_max_gib * 2**30
                    rec["dense_ms"] = median_ms(call(paged_attention_dense), device, args.reps) if fits else None
                    rec.update({f"{col}_ms": None for col in TRITON_PATHS}, max_err=None)
                    if use_triton:
                        rec.update(time_triton(call, device, args.reps))
                        if args.variants:
                            rec["variants_ms"] = time_variants(call, shape[0] // shape[1])
                    records.append(rec)
                    print(format_row(rec), flush=True)
    return records


def time_triton(call: Callable, device: str, reps: int) -> dict:
    """Graph-replay ms (`graph_replay_ms`) of each TRITON_PATHS kernel choice (`call(backend)` ->
    a no-argument closure) and the largest |Triton - torch_ref| over all of them (CUDA only)."""
    from blockdraft.attention.triton_attention import paged_attention_triton

    ref = call(paged_attention)().float()
    rec, errs = {}, []
    for col, multi_row in TRITON_PATHS.items():
        backend = functools.partial(paged_attention_triton, multi_row=multi_row)
        rec[f"{col}_ms"] = graph_replay_ms(call(backend))
        errs.append(float((call(backend)().float() - ref).abs().max()))
    return rec | {"max_err": max(errs)}


VARIANT_SPLITS = (1, 2, 4)


def time_variants(call: Callable, group: int) -> dict[str, float]:
    """Graph-replay ms of forced kernel configurations, for tuning `use_multi_row`,
    `multi_row_block_m` and the split rules: '1row-sS' (single-row kernel, S KV splits),
    'mM-auto' / 'mM-sS' (multi-row kernel with M = query rows x GQA group stacked, splits from
    the shapes or S). M runs over the powers of two from max(16, group) to 128."""
    from blockdraft.attention.triton_attention import paged_attention_triton

    configs = {f"1row-s{s}": dict(multi_row=False, num_kv_splits=s) for s in VARIANT_SPLITS}
    block_m = max(16, 1 << (group - 1).bit_length())
    while block_m <= 128:
        configs[f"m{block_m}-auto"] = dict(multi_row=True, block_m=block_m)
        for s in VARIANT_SPLITS:
            configs[f"m{block_m}-s{s}"] = dict(multi_row=True, block_m=block_m, num_kv_splits=s)
        block_m *= 2
    return {name: graph_replay_ms(call(functools.partial(paged_attention_triton, **kw))) for name, kw in configs.items()}


def format_row(rec: dict) -> str:
    def ms(x: float | None) -> str:
        return f"{x:10.4f}" if x is not None else f"{'-':>10}"

    err = f"{rec['max_err']:.1e}" if rec["max_err"] is not None else "-"
    triton_cols = "".join(ms(rec[f"{col}_ms"]) for col in TRITON_PATHS)
    row = (f"{rec['model']:<14}{rec['scenario']:<8}{rec['ctx']:>6}{rec['batch']:>6}{rec['rows']:>6}"
           f"{ms(rec['torch_ref_ms'])}{ms(rec['dense_ms'])}{triton_cols}  {err}")  # fmt: skip
    if rec.get("variants_ms"):
        best = min(rec["variants_ms"], key=rec["variants_ms"].get)
        row += f"  best variant {best} {rec['variants_ms'][best]:.4f}"
    return row


HEADER = (f"{'model':<14}{'scenario':<8}{'ctx':>6}{'batch':>6}{'rows':>6}"
          f"{'torch_ref':>10}{'dense':>10}{'triton':>10}{'multi':>10}{'1row':>10}  max_err (ms)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--device", default="cuda", help="cuda (all three backends) or cpu (no Triton column)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes / contexts / batches: a smoke test")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIO_ROWS), choices=list(SCENARIO_ROWS))
    p.add_argument("--ctx", type=int, nargs="+", default=None, help="cached tokens per request (default 1024 4096)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="requests per batch (default 1 8 32)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per CPU measurement (CUDA: do_bench decides)")
    p.add_argument("--dense-max-gib", type=float, default=24.0, help="skip the dense twin above this estimate")
    p.add_argument("--variants", action="store_true",
                   help="CUDA: also time forced kernel configurations (single-row x KV splits, multi-row "
                        "M x splits; `variants_ms` in the JSON, best one printed), for tuning the path choice")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    for flag, values in (("--batch", args.batch), ("--ctx", args.ctx), ("--reps", [args.reps])):
        if values is not None and min(values) < 1:
            p.error(f"{flag} must be >= 1, got {min(values)}")
    if args.dense_max_gib < 0:
        p.error(f"--dense-max-gib must be >= 0, got {args.dense_max_gib}")
    if args.variants and not args.device.startswith("cuda"):
        p.error("--variants times Triton kernel configurations: it needs --device cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny for a smoke test)")
    refuse_unwritable(p, "--out", args.out)  # before the run, not when writing its result
    args.ctx = args.ctx or ([24, 40] if args.tiny else [1024, 4096])
    args.batch = args.batch or ([1, 2] if args.tiny else [1, 8, 32])
    print(f"device {args.device}  dtype {args.dtype}  kv_block_size {KV_BLOCK_SIZE}  (median ms)")
    print(HEADER)
    with torch.inference_mode():
        records = run(args)
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                "dtype": args.dtype, "kv_block_size": KV_BLOCK_SIZE, "torch": torch.__version__}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
