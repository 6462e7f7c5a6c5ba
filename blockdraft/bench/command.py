"""`blockdraft bench`: HF generate vs z-lab dflash vs our plain and DFlash decoding, one process,
same prompts, same device, at several batch sizes; table on stdout, JSON + PNG on disk."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

DESCRIPTION = """\
Benchmark, in one process on one device: transformers `generate` (batched, left padding), the z-lab
reference `dflash_generate` (plain and DFlash, batch 1 only), our plain decoding and our DFlash
decoding, at batch 1 and at N concurrent requests. All engines share the same weights and prompts.

Sources (give one):
  --shape NAME   random weights of a real architecture, built on the device (qwen3-8b, qwen2.5-0.5b,
                 tiny for CPU smoke tests) with a random DFlash drafter; random prompts. Acceptance of a
                 random drafter is ~1 token/step, so the forced-acceptance row (on by default here) times
                 DFlash with drafts replaced by plain decoding's known continuation.
  --model NAME   a real model (catalog name, HF folder or .gguf) with --draft PATH|shipped, on
                 HumanEval / MT-bench prompts through the chat template.

Engines are built one at a time (each measured at every batch size, then dropped), as one engine
per server process. Every cell: --warmup full runs, then --repeats x (prefill-only run, full run)
with device-synchronised clocks; medians. ms/step = (t_full - t_prefill) / (steps_full -
steps_prefill): one target forward (plain) or one verify + draft + bookkeeping (DFlash). TTFT ms =
t_prefill, the time to the first token of every request of the batch. Greedy (T=0), EOS ignored,
--max-tokens tokens.
A cell is one closed batch of N requests by default. With --num-prompts M (>= every N) it sends M
requests with at most N in flight, the next as soon as one finishes (the load of a server at
concurrency N, as vLLM's benchmark_serving --max-concurrency N measures it: no tail where the last
requests of a batch run alone); HF runs them as batches of N in turn (the last one smaller), z-lab
(batch 1 only) one after another. TTFT ms is then not one request's time to first token but the
prefill-only run's: all M requests to their first token, N at a time.
Outputs of DFlash vs plain (and HF / z-lab vs ours) are compared token for token; mismatches are
counted, not hidden. Where our DFlash differs from our plain decoding, the target's top-2 gap at
the first divergent token is measured once more (an eager plain forward on the common prefix) and
the table says how many are near-ties (gap < 1e-2 between the two divergent tokens; the JSON has
every gap): in bf16 a verify step and a decode step sum in different orders.

Output: the table on stdout, and PREFIX.json + PREFIX.png where PREFIX is --out, by default
bench-<shape or model name> in the current folder (e.g. ./bench-tiny.json and ./bench-tiny.png).

The defaults (batch 1,8,32,64 x 128 tokens x 3 repeats + 1 warm-up) are for GPU numbers and take
minutes on a CPU. A CPU smoke test in about 10 s (files in /tmp; with --warmup 0 its first
timings include one-time costs, so TTFT and ms/step are not representative):
  blockdraft bench --shape tiny --device cpu --batch-sizes 1,8 --max-tokens 32 --repeats 1 --warmup 0 --out /tmp/bench-tiny
"""


def add_bench_parser(sub) -> None:
    """Register the `bench` subcommand on an argparse subparsers object."""
    from blockdraft.bench.shapes import H200_HBM_BYTES_PER_S, SHAPES
    from blockdraft.bench.suite import ENGINE_CHOICES
    from blockdraft.engine_args import add_batch_invariant_flag, add_draft_vocab_size_flag, add_fp32_lm_head_flag
    from blockdraft.weights.catalog import add_cache_dir_flag

    b = sub.add_parser("bench", help="throughput / step-time benchmark vs transformers and z-lab dflash",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=list(SHAPES), help="random weights of this architecture")
    src.add_argument("--model", help="real model: catalog name, HF folder or .gguf")
    b.add_argument("--draft", default=None,
                   help="with --model: DFlash drafter folder, 'shipped' (the one shipped for --model) or 'auto' "
                        "(shipped if there is one and not recorded slower than plain on this device type) "
                        "(default: none, plain rows only)")
    b.add_argument("--no-draft", action="store_true", help="with --shape: no drafter (plain rows only)")
    b.add_argument("--draft-layers", type=int, default=None,
                   help="with --shape: random drafter depth (default: 5 for qwen3-8b / qwen2.5-0.5b, 2 for tiny)")
    b.add_argument("--block-size", type=int, default=16, help="with --shape: drafter block size B (default 16)")
    b.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step K (default: with --model, the K `blockdraft generate` uses for the drafter "
                        "on this device type, recorded in its speculative.json; B - 1 where it records none, and "
                        "with --shape)")
    add_draft_vocab_size_flag(b, "; with --shape: ids 0..N-1 of the random vocabulary (times an N-column head)")
    b.add_argument("--prompt-len", type=int, default=128, help="with --shape: tokens per random prompt (default 128)")
    b.add_argument("--dataset", default="humaneval", choices=["humaneval", "mtbench"],
                   help="with --model: prompt set (default humaneval); a cell takes the first N prompts (N = "
                        "the batch size, or --num-prompts), repeating them past the set's size")
    b.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated concurrent requests (default 1,8,32,64)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    b.add_argument("--num-prompts", type=int, default=None,
                   help="requests per cell, sent with at most batch-size in flight: the next starts when one "
                        "finishes, as vLLM's benchmark_serving --max-concurrency (HF: batches of batch-size in "
                        "turn, the last one smaller; z-lab: batch 1 only, the requests in turn). Default: the "
                        "batch size, i.e. one closed batch per cell; must be >= every batch size. With --model "
                        "the prompts repeat past the dataset's (HumanEval 164, MT-bench 80)")
    b.add_argument("--repeats", type=int, default=3, help="timed repeats per cell, median reported (default 3)")
    b.add_argument("--warmup", type=int, default=1, help="untimed full runs before timing (default 1)")
    b.add_argument("--engines", default=",".join(ENGINE_CHOICES),
                   help=f"comma-separated subset of {','.join(ENGINE_CHOICES)} (ours always; default all)")
    b.add_argument("--forced", action=argparse.BooleanOptionalAction, default=None,
                   help="also time DFlash with forced acceptance (default: on with --shape, off with --model)")
    b.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto (default) = cuda if available, else cpu")
    b.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights / KV dtype (default auto: bf16 on CUDA, fp32 on CPU)")
    b.add_argument("--seed", type=int, default=0, help="random weights and prompts (default 0)")
    b.add_argument("--hbm-bandwidth", type=float, default=H200_HBM_BYTES_PER_S,
                   help=f"B/s for the HBM floor of a step (default {H200_HBM_BYTES_PER_S:.3g}, H200)")
    b.add_argument("--enforce-eager", action="store_true", default=None,
                   help="our LLM without CUDA graphs (enforce_eager=True): every step eager, so async scheduling off "
                        "and mixed prefill on")
    add_fp32_lm_head_flag(b)
    add_batch_invariant_flag(b)
    b.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="our LLM's async scheduling (default: on when CUDA graphs are captured)")
    from blockdraft.engine_args import add_admission_flags, add_mixed_prefill_flag

    add_mixed_prefill_flag(b)
    add_admission_flags(b)
    b.add_argument("--attention-backend", default=None, choices=["torch", "dense", "triton"],
                   help="our attention backend (default: the device's, triton on CUDA)")
    b.add_argument("--out", default=None,
                   help="output prefix: writes PREFIX.json and PREFIX.png (default: bench-<shape or model name> "
                   "in the current folder; a trailing .json is dropped: --out run.json writes run.json, run.png)")
    b.add_argument("--no-plot", action="store_true", help="write no PNG")
    add_cache_dir_flag(b, "model and data cache")
    b.set_defaults(func=run_bench)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,8,32' -> (1, 8, 32).

    Raises:
        ValueError: an entry that is not a positive integer (named).
    """
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--batch-sizes takes positive integers separated by commas, got {part!r} in {text!r}")
        if int(part) in out:
            raise ValueError(f"--batch-sizes lists {int(part)} twice in {text!r}; give each batch size once")
        out.append(int(part))
    return tuple(out)


def _check_source_flags(args) -> None:
    if args.shape and args.draft is not None:
        raise ValueError("--draft is for --model; with --shape the drafter is random (see --draft-layers, --no-draft)")
    if args.model and (args.no_draft or args.draft_layers is not None):
        raise ValueError("--no-draft / --draft-layers are for --shape; with --model, leave out --draft for plain only")
    if args.num_speculative_tokens is not None and (args.no_draft or (args.model and args.draft is None)):
        raise ValueError("--num-speculative-tokens needs a drafter (--draft with --model; no --no-draft with --shape)")
    if args.prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.shape and args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2 (1 anchor + at least 1 draft), got {args.block_size}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (timed runs per cell), got {args.repeats}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0 (untimed runs per cell), got {args.warmup}")
    if args.out is not None and not args.out.strip():
        raise ValueError("--out is empty; give a file prefix (writes PREFIX.json and PREFIX.png), e.g. 'bench-run'")


def check_drafter_flags(args, device_type: str = "cpu") -> tuple[str | None, int]:
    """The drafter flags against the target's config, before any weights are built or loaded:
    with --shape the random drafter's shape, K and the draft vocabulary size (ids 0..N-1, N in
    [0, vocab]); with --model the drafter folder, its config against the model's config.json, K
    and the draft vocabulary size (blockdraft.preflight on `device_type`, "cpu" | "cuda": `auto`,
    K and the draft vocabulary size as `blockdraft generate` resolves them there). Returns (the
    drafter folder (--model; None: plain rows only) or None (--shape), the draft vocabulary size
    (0: full vocabulary)).

    Raises:
        ValueError / FileNotFoundError: naming the flag value and what is allowed.
    """
    if args.shape:
        from blockdraft.bench.random_weights import random_drafter_shape
        from blockdraft.bench.shapes import get_shape, model_config

        shape = get_shape(args.shape)
        n = args.draft_vocab_size or 0
        if not args.no_draft:
            config = random_drafter_shape(model_config(shape), args.draft_layers or shape.draft_layers, args.block_size)
            if args.num_speculative_tokens is not None:
                config.check_num_speculative_tokens(args.num_speculative_tokens)
            if isinstance(n, bool) or not 0 <= n <= config.vocab_size:
                raise ValueError(f"--draft-vocab-size with --shape must be in [0, {config.vocab_size}] (ids 0..N-1 of "
                                 f"the random vocabulary; 0: full), got {args.draft_vocab_size}")
        elif n:
            raise ValueError("--draft-vocab-size needs a drafter; drop --no-draft")
        return None, n
    from blockdraft.preflight import preflight

    pre = preflight(args.model, args.draft, args.num_speculative_tokens, device=device_type, cache_dir=args.cache_dir,
                    draft_vocab_size=args.draft_vocab_size)
    return pre.draft, pre.draft_vocab_size


def build_workload(args):
    """The Workload the flags describe (see bench/workload.py)."""
    from blockdraft.bench.workload import model_workload, random_workload, resolve_device_dtype

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    num_prompts = max(max(parse_batch_sizes(args.batch_sizes)), args.num_prompts or 0)
    draft, draft_vocab_size = check_drafter_flags(args, device.type)
    if args.shape:
        return random_workload(args.shape, device, dtype, num_prompts=num_prompts, prompt_len=args.prompt_len,
                               draft_layers=args.draft_layers, block_size=args.block_size,
                               with_drafter=not args.no_draft, seed=args.seed, draft_vocab_size=draft_vocab_size)
    engines = {e.strip().lower() for e in args.engines.split(",")}
    return model_workload(args.model, draft, device, dtype, dataset=args.dataset, num_prompts=num_prompts,
                          cache_dir=args.cache_dir, draft_vocab_size=draft_vocab_size,
                          load_hf=bool(engines & {"hf", "zlab"}))


def floor_of(workload, hbm_bytes_per_s: float) -> dict:
    """HBM floors of a plain and a DFlash step for this workload's target (and drafter)."""
    from blockdraft.bench.shapes import dflash_extra_bytes, hbm_floor_ms, weight_bytes_per_forward

    elem = workload.dtype.itemsize
    weights = weight_bytes_per_forward(workload.config, elem)
    out = {"hbm_bytes_per_s": hbm_bytes_per_s, "target_weight_bytes": weights,
           "plain_step_floor_ms": hbm_floor_ms(weights, hbm_bytes_per_s), "dflash_extra_bytes": None,
           "dflash_step_floor_ms": None}
    if workload.drafter is not None:
        extra = dflash_extra_bytes(sum(p.numel() for p in workload.drafter.parameters()), workload.config, elem)
        out.update(dflash_extra_bytes=extra, dflash_step_floor_ms=hbm_floor_ms(weights + extra, hbm_bytes_per_s))
    return out


def device_info(device) -> dict:
    """Device name and library versions (into the JSON)."""
    import importlib.metadata as md

    import torch
    import transformers

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"type": device.type, "name": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "dflash": version("dflash"), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def out_prefix(out: str) -> str:
    """--out as a file prefix: a trailing ".json" is dropped, so `--out run.json` writes run.json
    and run.png rather than run.json.json."""
    return out[: -len(".json")] if out.lower().endswith(".json") and len(out) > len(".json") else out


def check_out_prefix(out: str) -> None:
    """Refuse an --out prefix before minutes of benchmarking: a folder (PREFIX.json would land
    beside it, e.g. '/tmp' -> '/tmp.json'), or a place where PREFIX.json cannot be written.
    Creates the prefix's parent folder, as the run would.

    Raises:
        ValueError: naming --out and the value.
    """
    from blockdraft.errors import check_writable_file

    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a folder; --out is a file prefix (writes PREFIX.json and "
                         f"PREFIX.png), e.g. {os.path.join(out, 'bench')!r}")
    for name in (out + ".json", out + ".png"):
        if os.path.isdir(name):
            raise ValueError(f"--out {out!r}: {name!r}, where the report would go, is a folder; choose another prefix")
    blocking = next((a for a in Path(out).parents if a.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ValueError(f"--out {out!r}: {str(blocking)!r} is a file, not a folder")
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r}: cannot create its folder ({e.strerror or e})") from None
    check_writable_file(out + ".json", "--out")


def run_bench(args) -> int:
    """CLI entry: build the workload, run the matrix, print the table, write JSON (+ PNG).

    Returns 0, or 1 when a cell failed with an error (the report still holds everything else).
    """
    from blockdraft.bench import report as rep
    from blockdraft.bench.engines.ours import check_llm_options
    from blockdraft.bench.suite import Settings, add_divergence_gaps, log, num_speculative_tokens, run_matrix
    from blockdraft.engine.scheduler import check_admission_settings

    from blockdraft.bench.workload import resolve_device_dtype
    from blockdraft.runner.setup import check_batch_invariant, check_fp32_lm_head

    _check_source_flags(args)
    check_admission_settings(args.admission_batch_ratio, args.admission_max_wait_steps)  # before any model loads
    device_type = resolve_device_dtype(args.device, args.dtype)[0].type
    check_fp32_lm_head(args.enable_fp32_lm_head, device_type)
    check_batch_invariant(args.batch_invariant, device_type, args.attention_backend)
    if args.out:
        check_out_prefix(out_prefix(args.out))
    engines = tuple(e.strip().lower() for e in args.engines.split(",") if e.strip())
    # Our KV pools are sized explicitly (PoolPlan) so that several engines and the HF model share
    # one GPU; gpu_memory_utilization (which sizes a pool to most of the GPU) is therefore not used.
    options = check_llm_options({"enforce_eager": args.enforce_eager, "attention_backend": args.attention_backend,
                                 "async_scheduling": args.async_scheduling, "mixed_prefill": args.mixed_prefill,
                                 "admission_batch_ratio": args.admission_batch_ratio,
                                 "admission_max_wait_steps": args.admission_max_wait_steps,
                                 "enable_fp32_lm_head": args.enable_fp32_lm_head or None,
                                 "batch_invariant": args.batch_invariant or None})
    forced = bool(args.shape) if args.forced is None else args.forced
    settings = Settings(parse_batch_sizes(args.batch_sizes), args.max_tokens, args.repeats, args.warmup, engines,
                        forced, args.num_speculative_tokens, options, args.num_prompts)
    log("building models")
    workload = build_workload(args)
    prefix = Path(out_prefix(args.out) if args.out else f"bench-{Path(workload.name).name}")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    base = {
        "schema": rep.SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workload": {"name": workload.name, **workload.source, "arch": workload.config.arch,
                     "num_hidden_layers": workload.config.num_hidden_layers,
                     "hidden_size": workload.config.hidden_size},
        "device": device_info(workload.device),
        "dtype": str(workload.dtype).replace("torch.", ""),
        "settings": {"batch_sizes": list(settings.batch_sizes), "num_prompts": settings.num_prompts,
                     "max_tokens": settings.max_tokens,
                     "repeats": settings.repeats, "warmup": settings.warmup, "engines": list(engines),
                     "forced": forced, "num_speculative_tokens": num_speculative_tokens(workload, settings),
                     "block_size": workload.drafter.config.block_size if workload.drafter else None,
                     "draft_layers": workload.drafter.config.num_hidden_layers if workload.drafter else None,
                     "draft_vocab_size": workload.draft_head.size if workload.draft_head is not None else 0,
                     "llm_options": options,
                     # the flag as given (None: each engine's default); the effective ratio of each
                     # of our engines is filled in by `assemble` from the runs (as load_profile)
                     "admission_batch_ratio_flag": args.admission_batch_ratio},
        "floor": floor_of(workload, args.hbm_bandwidth),
    }
    json_path = prefix.with_name(prefix.name + ".json")

    def assemble(cells, parity, skipped) -> dict:
        rows = rep.add_speedups([c.summary() for c in cells])
        ours = [c for c in cells if c.engine == "ours"]  # the engines with our scheduler
        effective = {"admission_batch_ratio": {c.mode: c.admission_batch_ratio for c in ours},
                     "mixed_prefill": {c.mode: c.mixed_prefill for c in ours}}
        doc = {**base, "settings": {**base["settings"], **effective}, "results": rows, "parity": parity, "skipped": skipped,
               "criteria": rep.criteria(rows, base["floor"], gpu=base["device"]["type"] == "cuda")}
        rep.validate_report(doc)
        return doc

    def save(doc: dict) -> None:
        json_path.write_text(json.dumps(doc, indent=1) + "\n")

    cells, parity, skipped = run_matrix(workload, settings, on_engine=lambda c, p, s: save(assemble(c, p, s)))
    if any(p["mismatched_requests"] and p["candidate"] == "ours/dflash" and p["reference"] == "ours/plain"
           for p in parity):
        log("checking the divergences of DFlash from plain decoding for near-ties")
    add_divergence_gaps(workload, settings, cells, parity)
    doc = assemble(cells, parity, skipped)
    save(doc)
    print(rep.format_table(doc))
    print(f"wrote {json_path}")
    if not args.no_plot:
        png = prefix.with_name(prefix.name + ".png")
        try:
            from blockdraft.bench.plot import plot_report

            plot_report(doc, str(png))
            print(f"wrote {png}")
        except ValueError as e:
            print(f"no plot: {e}")
    return 1 if any(c.status == "error" for c in cells) else 0
