"""CPU benchmark: our greedy decoding vs transformers `generate`, same model, prompt and machine.

Each engine runs in its own child process (so peak RSS is per engine, read with os.wait4), one after
the other, `--repeats` times, alternating; the table reports medians and the ratio.

    python -m blockdraft.bench.cpu_vs_hf --model qwen2.5-coder-0.5b-instruct --max-tokens 64 [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from blockdraft.errors import refuse_unwritable

PROMPT = "Write a Python function that checks whether a number is prime."


def _child_ours(model: str, max_tokens: int, dtype: str) -> dict:
    from blockdraft.llm import LLM
    from blockdraft.sampling_params import SamplingParams

    llm = LLM(model=model, dtype=dtype)
    prompt = [{"role": "user", "content": PROMPT}]
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    dt = time.perf_counter() - t0
    return {"tokens": out.num_output_tokens, "seconds": dt, "token_ids": out.token_ids}


def _child_hf(model: str, max_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from blockdraft.weights.fetch import resolve_model_path
    from blockdraft.weights.loader import load_tokenizer

    path = resolve_model_path(model)
    tok = load_tokenizer(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        dt = time.perf_counter() - t0
    new = out[0, ids.shape[1] :].tolist()
    return {"tokens": len(new), "seconds": dt, "token_ids": new}


def _child_command(engine: str, args) -> list[str]:
    """The command line of one measured child; --threads is passed on (both engines alike)."""
    cmd = [sys.executable, "-m", "blockdraft.bench.cpu_vs_hf", "--child", engine, "--model", args.model,
           "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
    return cmd + ([] if args.threads is None else ["--threads", str(args.threads)])


def _run_child(engine: str, args) -> dict:
    proc = subprocess.Popen(_child_command(engine, args), stdout=subprocess.PIPE, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{engine} child failed with status {status}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux
    return result


def main(argv: list[str] | None = None) -> int:
    from blockdraft.cpu_threads import add_threads_flag, apply_threads_flag

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name or model folder (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per run (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="both engines' dtype (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, alternating; medians reported (default %(default)s)")
    p.add_argument("--json-out", default="cpu_vs_hf.json", help="where the JSON goes (default %(default)s)")
    p.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    add_threads_flag(p)
    args = p.parse_args(argv)
    apply_threads_flag(p, args.threads)  # the children are the ones measured: they get --threads too
    if args.child:
        fn = _child_ours if args.child == "ours" else _child_hf
        print(json.dumps(fn(args.model, args.max_tokens, args.dtype)))
        return 0
    refuse_unwritable(p, "--json-out", args.json_out)  # before the runs, not when writing their result
    if args.threads is None:  # chosen once here from the load, then the same for every child (and recorded)
        import torch

        args.threads = torch.get_num_threads()
    runs = {"ours": [], "hf": []}
    for _ in range(args.repeats):
        for engine in ("ours", "hf"):
            runs[engine].append(_run_child(engine, args))
    report = _report(runs, args)
    with open(args.json_out, "w") as f:
        json.dump(report, f, indent=2)
    _print_table(report)
    return 0


def _report(runs: dict, args) -> dict:
    rows = {}
    for engine, rs in runs.items():
        rows[engine] = {
            "tokens_per_s_median": statistics.median(r["tokens"] / r["seconds"] for r in rs),
            "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in rs),
            "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rs],
        }
    same = runs["ours"][0]["token_ids"] == runs["hf"][0]["token_ids"]
    return {
        "model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "prompt": PROMPT, "cpu_count": os.cpu_count(), "threads": args.threads, "identical_tokens": same,
        "engines": rows,
        "speedup_ours_over_hf": rows["ours"]["tokens_per_s_median"] / rows["hf"]["tokens_per_s_median"],
    }


def _print_table(rep: dict) -> None:
    print(f"model {rep['model']} ({rep['dtype']}), {rep['max_tokens']} tokens, median of {rep['repeats']}")
    print(f"{'engine':<8}{'tok/s':>10}{'peak RSS MiB':>15}")
    for engine, row in rep["engines"].items():
        print(f"{engine:<8}{row['tokens_per_s_median']:>10.2f}{row['peak_rss_mib_median']:>15.0f}")
    print(f"speedup ours/hf: {rep['speedup_ours_over_hf']:.2f}x; identical tokens: {rep['identical_tokens']}")


if __name__ == "__main__":
    sys.exit(main())
