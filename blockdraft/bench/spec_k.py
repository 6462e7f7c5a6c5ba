"""Which K (drafts per step) is fastest for a drafter on this machine? Plain vs DFlash at several K.

One process loads the target once; plain decoding and one DFlash engine per (K, draft vocabulary
size) share it and run every prompt interleaved (blockdraft.side_by_side), `--repeats` times,
medians. Prints a table of K, draft vocabulary, acceptance length, tokens/s and speedup over plain,
and checks every answer equals plain decoding. `--write-default` stores the fastest K (and its draft
vocabulary size) in the drafter folder's speculative.json, which `LLM` / `blockdraft generate` use
when --num-speculative-tokens / --draft-vocab-size are not given; when even the fastest K is slower
than plain decoding it also records `"draft_auto": false`, so `--draft auto` decodes plainly on the
CPU with that drafter.

    python -m blockdraft.bench.spec_k --model qwen2.5-coder-0.5b-instruct \\
        --ks 1,2,3,4,7,15 --max-tokens 64 --repeats 3 --write-default

Run it as the engine is used, without OMP_WAIT_POLICY=PASSIVE: on a 2-core CPU that setting made
plain decoding 1.6-1.7x slower and DFlash slower still, which moved the fastest K
(docs/benchmarks/speculative-k-cpu.md "Session 22").
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

from blockdraft.side_by_side import TimedRun, compare_engines

PLAIN = "plain"


def label(k: int, draft_vocab_size: int = 0) -> str:
    """Engine label of one (K, draft vocabulary size) setting: "K=3" or "K=3,V=32768"."""
    return f"K={k}" if not draft_vocab_size else f"K={k},V={draft_vocab_size}"


def k_table(runs: dict[str, list[TimedRun]], ks: list) -> list[dict]:
    """Rows {k, draft_vocab_size, acceptance_length, tokens_per_s, speedup, cpu_speedup,
    per_prompt_speedup, identical}, one per entry of `ks`: K, or (K, draft vocabulary size).

    Pooled over prompts: acceptance length over all verify steps; speedup = total median plain wall
    time / total median wall time at K (equal token counts when identical); cpu_speedup the same
    with process CPU time (steadier when other jobs share the machine).
    """
    plain = runs[PLAIN]
    plain_s = sum(r.median_seconds for r in plain)
    plain_cpu = sum(r.median_cpu_seconds for r in plain)
    rows = []
    for entry in ks:
        k, vocab = entry if isinstance(entry, tuple) else (entry, 0)
        spec = runs[label(k, vocab)]
        steps = sum(r.output.spec.num_steps for r in spec)
        accepted = sum(r.output.spec.num_accepted_tokens for r in spec)
        seconds = sum(r.median_seconds for r in spec)
        tokens = sum(r.output.num_output_tokens for r in spec)
        rows.append({
            "k": k,
            "draft_vocab_size": vocab,
            "acceptance_length": (accepted + steps) / steps if steps else None,
            "tokens_per_s": tokens / seconds,
            "speedup": plain_s / seconds,
            "cpu_speedup": plain_cpu / sum(r.median_cpu_seconds for r in spec),
            "per_prompt_speedup": [p.median_seconds / s.median_seconds for p, s in zip(plain, spec)],
            "identical": all(s.output.token_ids == p.output.token_ids and s.deterministic for p, s in zip(plain, spec)),
        })
    return rows


def best_row(rows: list[dict], metric: str = "speedup") -> dict:
    """The row with the highest pooled `metric` ("speedup" or "cpu_speedup") among rows whose
    answers were identical (ties: smaller K, then smaller draft vocabulary).

    Raises:
        ValueError: no row with identical answers, or an unknown metric.
    """
    if metric not in ("speedup", "cpu_speedup"):
        raise ValueError(f"metric must be 'speedup' or 'cpu_speedup', got {metric!r}")
    ok = [r for r in rows if r["identical"]]
    if not ok:
        raise ValueError("no K produced answers identical to plain decoding; not choosing a default")
    return max(ok, key=lambda r: (r[metric], -r["k"], -r.get("draft_vocab_size", 0)))


def parse_int_list(text: str, flag: str, minimum: int) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: comma-separated integers >= `minimum`.

    Raises:
        ValueError: an empty entry or one that is not an integer >= `minimum`, naming `flag`.
    """
    values = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{flag}: {part.strip()!r} in {text!r} is not an integer; "
                             f"give comma-separated integers, e.g. 1,2,3") from None
        if value < minimum:
            raise ValueError(f"{flag}: {value} in {text!r} must be >= {minimum}")
        values.append(value)
    return values


def main(argv: list[str] | None = None) -> int:
    """Run the table; exit 1 when a K's answers differ from plain decoding.

    Bad flags (--ks, --draft-vocab-sizes, --repeats, --max-tokens, --dtype, an unwritable --json)
    are usage errors (exit 2) before anything loads; so is a K or draft vocabulary size the drafter
    folder refuses (preflight, no weights read). Any other error from the library (a bad --model or
    --draft: ValueError / FileNotFoundError) is one `error:` line on stderr, exit 2, no traceback.
    """
    from blockdraft.cpu_threads import add_threads_flag, apply_threads_flag
    from blockdraft.drafters import SHIPPED
    from blockdraft.errors import flag_message, refuse_unwritable
    from blockdraft.preflight import DTYPE_CHOICES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                   help="catalog name or model folder (default %(default)s)")
    p.add_argument("--draft", default=SHIPPED, help="drafter folder or 'shipped' (default; 'auto' is the same here)")
    p.add_argument("--ks", default="1,2,3,4,7,15",
                   help="comma-separated K values (drafts per step), each in [1, block_size - 1] of the drafter "
                        "(default %(default)s)")
    p.add_argument("--draft-vocab-sizes", default="0",
                   help="comma-separated draft vocabulary sizes to try with every K (0 = full vocabulary; "
                        "N needs the drafter's draft_vocab.json); default 0")
    p.add_argument("--prompts", nargs="+", default=None, help="prompts (default: the demo's prompts)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer, >= 1 (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, >= 0 (default 0: greedy); above 0 every request is seeded with --seed, "
                        "so plain and speculative answers still compare token for token; not with --write-default "
                        "(the default K is chosen greedy)")
    p.add_argument("--seed", type=int, default=0, help="the requests' seed when --temperature > 0 (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per prompt and engine, >= 1; medians (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights/KV dtype (default %(default)s: the checkpoint's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the table and all timings here")
    p.add_argument("--choose-by", default="speedup", choices=["speedup", "cpu_speedup"],
                   help="wall-time speedup (default) or CPU-time speedup (use on a shared machine)")
    p.add_argument("--write-default", action="store_true",
                   help="store the fastest K in the drafter folder's speculative.json (the shipped folder for 'shipped')")
    p.add_argument("--cache-dir", default=None)
    add_threads_flag(p)
    args = p.parse_args(argv)
    try:
        ks = [(k, v) for k in parse_int_list(args.ks, "--ks", 1)
              for v in parse_int_list(args.draft_vocab_sizes, "--draft-vocab-sizes", 0)]
    except ValueError as e:
        p.error(str(e))
    for flag, value in (("--repeats", args.repeats), ("--max-tokens", args.max_tokens)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature must be a number >= 0, got {args.temperature:g}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.write_default and args.temperature > 0:
        p.error(f"--write-default records the greedy measurement: drop --temperature {args.temperature:g}")
    if any(not t.strip() for t in args.prompts or []):
        p.error("--prompts: a prompt is empty")
    refuse_unwritable(p, "--json", args.json)  # now, not after minutes of timing
    # before the target loads (the table's "machine" records it), after the flag errors: no notice before them
    apply_threads_flag(p, args.threads)
    try:
        return _measure(args, argv, ks, p)
    except (ValueError, FileNotFoundError) as e:  # e.g. a bad --model / --draft: one line, no traceback
        print(f"error: {flag_message(e, p._option_string_actions)}", file=sys.stderr)
        return 2


def _measure(args, argv: list[str] | None, ks: list[tuple[int, int]], p) -> int:
    """main's body after the flags are checked: check every (K, vocabulary) against the drafter,
    load, time, print the table, write --json and --write-default."""
    from blockdraft.demo import DEMO_PROMPTS
    from blockdraft.drafters import AUTO, SHIPPED, SHIPPED_DIR, resolve_draft
    from blockdraft.llm import LLM
    from blockdraft.model_loader import load_target
    from blockdraft.preflight import preflight
    from blockdraft.sampling_params import SamplingParams
    from blockdraft.errors import refuse_unwritable
    from blockdraft.spec.dflash.checkpoint import SPECULATIVE_FILE, write_recommended_num_speculative_tokens

    if args.draft == AUTO:  # a measurement of the drafter: the shipped one, also where auto would skip it
        args.draft = SHIPPED
    draft = resolve_draft(args.draft, args.model, cache_dir=args.cache_dir)
    default_folder = SHIPPED_DIR / args.model if args.draft == SHIPPED else Path(draft)
    if args.write_default:  # now, not after minutes of timing
        refuse_unwritable(p, "--write-default", str(default_folder / SPECULATIVE_FILE))
    for k, v in ks:  # the drafter's K range and vocabulary, before seconds of loading the target
        try:
            preflight(args.model, draft, k, args.dtype, kv_block_size=16, num_kv_blocks=128,
                      cache_dir=args.cache_dir, draft_vocab_size=v)
        except ValueError as e:
            # a K or vocabulary size this drafter refuses is a bad --ks / --draft-vocab-sizes entry
            flag = {"num_speculative_tokens": "--ks", "draft_vocab_size": "--draft-vocab-sizes"}.get(
                getattr(e, "param", None))
            if flag is None:
                raise
            p.error(f"{flag}: {e}")
    target = load_target(args.model, args.dtype, cache_dir=args.cache_dir)
    small_pool = dict(num_kv_blocks=128, kv_block_size=16)  # 2048 tokens: plenty for short prompts
    engines = {PLAIN: LLM(target=target, **small_pool)}
    for k, v in ks:
        engines[label(k, v)] = LLM(target=target, draft=draft, num_speculative_tokens=k, draft_vocab_size=v,
                                   **small_pool)
    prompts = [[{"role": "user", "content": t}] for t in (args.prompts or DEMO_PROMPTS)]
    # seeded when sampled: the sample at each position is a function of (seed, position, logits), so the
    # speculative answers must equal plain decoding's token for token here too
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed if args.temperature > 0 else None)

    def progress(label, i, r, seconds):
        print(f"  repeat {r + 1} prompt {i + 1}: {label} {seconds:.2f} s", file=sys.stderr, flush=True)

    runs = compare_engines(engines, prompts, params, args.repeats, on_run=progress)
    rows = k_table(runs, ks)
    plain_tps = sum(r.output.num_output_tokens for r in runs[PLAIN]) / sum(r.median_seconds for r in runs[PLAIN])
    sampling = "greedy" if args.temperature == 0 else f"T = {args.temperature:g}, seed {args.seed}"
    print(f"{args.model} ({target.dtype}), drafter {draft}, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"{sampling}, {args.repeats} repeats (medians); plain {plain_tps:.1f} tok/s")
    print("| K | draft vocab | acceptance length | tok/s | speedup vs plain (wall) | per-prompt (wall) | "
          "speedup (CPU time) | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tau = "n/a" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        per = ", ".join(f"{x:.2f}" for x in r["per_prompt_speedup"])
        vocab = r["draft_vocab_size"] or "full"
        print(f"| {r['k']} | {vocab} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {per} | "
              f"{r['cpu_speedup']:.2f}x | {r['identical']} |")
    evidence = {
        "measured": datetime.date.today().isoformat(),
        "command": "python -m blockdraft.bench.spec_k " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} CPU, {__import__('torch').get_num_threads()} threads",
        "target": args.model, "dtype": str(target.dtype).replace("torch.", ""),
        "max_tokens": args.max_tokens, "temperature": args.temperature,
        **({"seed": args.seed} if args.temperature > 0 else {}),
        "repeats": args.repeats, "plain_tokens_per_s": round(plain_tps, 2),
        "table": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "per_prompt_speedup"}
                  for r in rows],
    }
    if args.json:
        timings = {label: [r.seconds for r in rs] for label, rs in runs.items()}
        cpu = {label: [r.cpu_seconds for r in rs] for label, rs in runs.items()}
        Path(args.json).write_text(json.dumps(evidence | {"rows": rows, "seconds": timings, "cpu_seconds": cpu}, indent=1))
    if args.write_default:
        best = best_row(rows, args.choose_by)
        evidence["chosen_by"] = args.choose_by
        if best["draft_vocab_size"]:  # read back by LLM as the default --draft-vocab-size
            evidence = {"draft_vocab_size": best["draft_vocab_size"], **evidence}
        slower = best[args.choose_by] < 1.0
        if slower:  # --draft auto then decodes plainly here (checkpoint.draft_auto_off_reason)
            evidence = {"draft_auto": False, **evidence}
        file = write_recommended_num_speculative_tokens(default_folder, best["k"], evidence)
        print(f"fastest: K = {best['k']}, draft vocabulary {best['draft_vocab_size'] or 'full'}; wrote {file}"
              + (' (slower than plain decoding: recorded "draft_auto": false, so --draft auto skips a shipped '
                 "drafter on this device type)" if slower else ""))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
