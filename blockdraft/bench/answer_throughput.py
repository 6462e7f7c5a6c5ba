"""Throughput of our engine answering many requests at once (the drafter-data regime, and a loaded
server's): random weights of a real shape, N requests of varied prompt lengths fed through at most
`--max-num-seqs` at a time (so most steps mix prefill and decode), a share sampled at T = 0.7 with
per-request seeds; the runner's sampler compiled (torch.compile, the CUDA default) and eager,
alternated, with the tokens of every run checked equal.

    python -m blockdraft.bench.answer_throughput --shape qwen2.5-0.5b --requests 2048 --out r.json
    python -m blockdraft.bench.answer_throughput --shape tiny --device cpu --requests 16 --samplers eager  # smoke

Prints a table (median of `--repeats` per sampler; the first compiled run also compiles and is not
counted); `--out PATH` writes JSON. Also times the sampler alone on `--max-num-seqs` rows of the
shape's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdraft.errors import refuse_unwritable

SAMPLERS = ("compiled", "eager")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()  # as the runner samples: the compiled sampler's graphs guard on it
def sampler_ms(vocab: int, rows: int, device: str, compiled: bool, iters: int = 10) -> float:
    """Milliseconds per `sample` call on [rows, vocab] random logits, all rows at T = 0.7."""
    from blockdraft.sample import SamplingTensors
    from blockdraft.sampling_params import SamplingParams

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.7, seed=i) for i in range(rows)], device=device)
    pos = torch.arange(rows, device=device)
    st.sample(logits, pos, compiled=compiled)  # warm-up (and compile)
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        st.sample(logits, pos, compiled=compiled)
    _sync(device)
    return (time.perf_counter() - t) * 1000 / iters


def run(args) -> dict:
    """All measurements; see the module docstring. Raises ValueError for a device that is not there."""
    from blockdraft.bench.random_weights import random_target
    from blockdraft.bench.shapes import get_shape
    from blockdraft.llm import LLM
    from blockdraft.training.generate import generate_with_engine

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (use --device cpu for a smoke run)")
    shape = get_shape(args.shape)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    _, target = random_target(shape, dtype, args.device)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    sampled = [i % 4 != 0 for i in range(args.requests)]  # 75 % sampled, as the drafter-data runs
    pages = args.max_num_seqs * -(-(args.max_prompt + args.max_tokens + 1) // 16)
    llm = LLM(target=target, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(4096, args.max_prompt + 1), num_kv_blocks=pages)
    result = {"shape": shape.name, "device": args.device, "requests": args.requests, "max_tokens": args.max_tokens,
              "max_num_seqs": args.max_num_seqs, "sampled_share": 0.75, "runs": {}, "sampler_ms": {}}
    reference = None
    order = [s for _ in range(args.repeats) for s in args.samplers]
    if "compiled" in args.samplers:
        order = ["compiled"] + order  # compiles (not counted)
    for i, name in enumerate(order):
        llm.engine.runner.compiled_sampling = name == "compiled"
        t = time.perf_counter()
        tokens = generate_with_engine(llm, prompts, args.max_tokens, sampled, seed=3)
        seconds = time.perf_counter() - t
        if reference is None:
            reference = tokens
        elif tokens != reference:
            raise RuntimeError(f"sampler {name!r} produced other tokens than the first run")
        if i == 0 and "compiled" in args.samplers:
            result["compile_run_s"] = round(seconds, 2)
            continue
        result["runs"].setdefault(name, []).append({"seconds": round(seconds, 3),
                                                    "tokens_per_s": round(sum(map(len, tokens)) / seconds, 1),
                                                    "requests_per_s": round(args.requests / seconds, 1)})
    for name in args.samplers:
        result["sampler_ms"][name] = round(sampler_ms(vocab, args.max_num_seqs, args.device, name == "compiled"), 3)
    result["same_tokens"] = True
    return result


def print_table(result: dict) -> None:
    print(f"{result['shape']} on {result['device']}: {result['requests']} requests, at most {result['max_num_seqs']} "
          f"at once, max_tokens {result['max_tokens']}, 75 % sampled; tokens identical across runs")
    print(f"{'sampler':10} {'tok/s (median)':>15} {'req/s':>8} {'sampler ms @rows':>17}")
    for name, runs in result["runs"].items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        rps = statistics.median(r["requests_per_s"] for r in runs)
        print(f"{name:10} {tps:15.0f} {rps:8.1f} {result['sampler_ms'][name]:17.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockdraft.bench.answer_throughput", allow_abbrev=False,
                                description="Throughput of our engine answering many requests at once, sampler compiled vs eager.")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="model shape (blockdraft.bench.shapes; default qwen2.5-0.5b)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (default: the regime this measures) or cpu (a smoke run with --shape tiny)")
    p.add_argument("--requests", type=int, default=2048, help="requests per run (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=512, help="requests answered at once (default 512)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens (default 32)")
    p.add_argument("--max-prompt", type=int, default=400, help="longest prompt, tokens (default 400)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per sampler (default 2)")
    p.add_argument("--samplers", type=lambda s: s.split(","), default=list(SAMPLERS),
                   help="comma-separated: compiled, eager (default both)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    bad = [s for s in args.samplers if s not in SAMPLERS]
    args.samplers = list(dict.fromkeys(args.samplers))  # each once
    if bad:
        p.error(f"--samplers: unknown {bad}; allowed: {', '.join(SAMPLERS)}")
    for name in ("requests", "max_num_seqs", "max_tokens", "min_prompt", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt < args.min_prompt:
        p.error(f"--max-prompt ({args.max_prompt}) must be >= --min-prompt ({args.min_prompt})")
    refuse_unwritable(p, "--out", args.out)  # before the run, not when writing its result
    try:
        result = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
