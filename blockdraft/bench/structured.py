"""Structured outputs with and without DFlash: plain vs speculative decoding of constrained answers.

One process loads the target once; plain decoding and DFlash (the shipped drafter unless --draft)
answer each task interleaved (blockdraft.side_by_side), `--repeats` times, medians. Each task is a
chat prompt with a constraint (JSON Schemas, a regex, a choice). Prints a table per task and
pooled (tokens, tok/s, acceptance length, speedup, identical answers, answer follows its
constraint) and the host time the grammar takes per step (masks and advancing), and writes JSON.
A DFlash answer that differs from plain decoding's is checked for a near-tie at its first
divergent token (bench.near_ties, judged by the two tokens' own gap since a grammar masks the
rest; in bf16 also on the target loaded in float32); the run fails (exit 1) only for a
divergence that is not a near-tie, a diverging DFlash answer that breaks its constraint, or
answers that change from run to run.

    python -m blockdraft.bench.structured --repeats 3 --json docs/benchmarks/structured-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import re
import shlex
import sys
import time
from pathlib import Path

PLAIN, DFLASH = "plain", "dflash"

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
SIGNATURE = {"type": "object", "additionalProperties": False, "required": ["name", "parameters", "returns"],
             "properties": {"name": {"type": "string"}, "returns": {"type": "string"},
                            "parameters": {"type": "array", "maxItems": 4, "items": {
                                "type": "object", "additionalProperties": False, "required": ["name", "type"],
                                "properties": {"name": {"type": "string"}, "type": {"type": "string"}}}}}}
TODO = {"type": "object", "additionalProperties": False, "required": ["tasks"],
        "properties": {"tasks": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["title", "done"],
            "properties": {"title": {"type": "string", "maxLength": 40}, "done": {"type": "boolean"}}}}}}
REQUEST = {"type": "object", "additionalProperties": False, "required": ["method", "url", "headers"],
           "properties": {"method": {"enum": ["GET", "POST", "PUT", "DELETE"]}, "url": {"type": "string"},
                          "headers": {"type": "object", "additionalProperties": {"type": "string"}}}}

# (name, prompt, StructuredOutputsParams fields)
TASKS = [
    ("person", "Describe a fictional programmer as JSON: name, age and languages.", {"json": PERSON}),
    ("signature", "Describe the Python function `def clamp(x: float, low: float, high: float) -> float` as JSON: "
                  "its name, its parameters (name and type) and its return type.", {"json": SIGNATURE}),
    ("todo", "Write a to-do list of three tasks for releasing a Python package, as JSON.", {"json": TODO}),
    ("http", "Write the HTTP request that creates a user through a REST API, as JSON with method, url and "
             "headers.", {"json": REQUEST}),
    ("json_object", "Give the three primary colours and their hex codes as a JSON object.", {"json_object": True}),
    ("date", "When was Python 3.0 released? Answer with the date only.", {"regex": r"\d{4}-\d{2}-\d{2}"}),
    ("choice", "Is this review positive or negative? 'The library is fast and its docs are clear.'",
     {"choice": ["positive", "negative"]}),
]


def follows(fields: dict, text: str) -> bool:
    """Whether `text` satisfies the task's constraint (JSON parses with the required keys; the
    regex matches the whole text; the choice is one of them)."""
    if "regex" in fields:
        return re.fullmatch(fields["regex"], text) is not None
    if "choice" in fields:
        return text in fields["choice"]
    try:
        value = json.loads(text)
    except ValueError:
        return False
    schema = fields.get("json", {})
    return isinstance(value, dict) and set(schema.get("required", ())) <= set(value)


class GrammarTimer:
    """Host seconds spent in the grammar while active: a step's masks (input_batch's
    fill_bitmasks), advancing over committed tokens and steering drafts (RequestGrammar)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "GrammarTimer":
        from blockdraft.runner import input_batch
        from blockdraft.structured.grammar import RequestGrammar

        self._saved = [(owner, name, getattr(owner, name)) for owner, name in (
            (input_batch, "fill_bitmasks"), (RequestGrammar, "advance"), (RequestGrammar, "steer_drafts"))]
        for owner, name, fn in self._saved:
            setattr(owner, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def task_rows(runs: dict, grammar_s: dict, steps: dict) -> list[dict]:
    """One row per task from {task: {label: TimedRun}}: tokens, tok/s (medians), acceptance
    length, speedup (plain median / DFlash median), identical, follows, grammar ms per step."""
    rows = []
    for name, fields in ((t[0], t[2]) for t in TASKS if t[0] in runs):
        plain, spec = runs[name][PLAIN], runs[name][DFLASH]
        s = spec.output.spec
        rows.append({
            "task": name,
            "tokens": plain.output.num_output_tokens,
            "plain_tokens_per_s": plain.tokens_per_s,
            "dflash_tokens_per_s": spec.tokens_per_s,
            "acceptance_length": (s.num_accepted_tokens + s.num_steps) / s.num_steps if s.num_steps else None,
            "speedup": plain.median_seconds / spec.median_seconds,
            "identical": spec.output.token_ids == plain.output.token_ids and spec.deterministic and plain.deterministic,
            "deterministic": spec.deterministic and plain.deterministic,  # every repeat gave the same tokens
            "follows": follows(fields, plain.output.text) and plain.output.finish_reason == "stop",
            # None: cut by --max-tokens, so whether it would follow cannot be told
            "dflash_follows": None if spec.output.finish_reason == "length" else (
                follows(fields, spec.output.text) and spec.output.finish_reason == "stop"),
            "grammar_ms_per_step": {label: 1e3 * grammar_s[name][label] / max(steps[name][label], 1)
                                    for label in (PLAIN, DFLASH)},
            "text": plain.output.text,
            "divergence": None,  # judge_divergences: the first divergent token's gaps
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the tasks; exit 1 unless every task passes (`passes`: DFlash's answer is plain decoding's,
    or differs first at a near-tie and still follows its constraint; answers stable over repeats).

    Bad flags are usage errors (exit 2) before anything loads; a bad --model / --draft is one
    `error:` line, exit 2.
    """
    from blockdraft.cpu_threads import add_threads_flag, apply_threads_flag
    from blockdraft.drafters import SHIPPED
    from blockdraft.errors import flag_message, refuse_unwritable
    from blockdraft.engine_args import add_batch_invariant_flag, add_draft_vocab_size_flag, add_fp32_lm_head_flag
    from blockdraft.preflight import DEVICE_CHOICES, DTYPE_CHOICES

    p = argparse.ArgumentParser(prog="python -m blockdraft.bench.structured", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name or model folder (default %(default)s)")
    p.add_argument("--draft", default=SHIPPED, help="drafter folder or 'shipped' (default)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts per step (default: the drafter's recorded K)")
    p.add_argument("--tasks", default=",".join(t[0] for t in TASKS),
                   help="comma-separated task names (default: all: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per answer at most (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per task and engine, >= 1; medians (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights/KV dtype (default %(default)s)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="auto (default) = cuda if available, else cpu")
    add_draft_vocab_size_flag(p)
    add_fp32_lm_head_flag(p)
    add_batch_invariant_flag(p)
    p.add_argument("--json", default=None, metavar="PATH", help="write the table and all timings here")
    p.add_argument("--cache-dir", default=None)
    add_threads_flag(p)
    args = p.parse_args(argv)
    apply_threads_flag(p, args.threads)
    names = [n for n in args.tasks.split(",") if n]
    unknown = sorted(set(names) - {t[0] for t in TASKS})
    if unknown or not names:
        p.error(f"--tasks: unknown task(s) {unknown}; choose from {', '.join(t[0] for t in TASKS)}")
    for flag, value in (("--repeats", args.repeats), ("--max-tokens", args.max_tokens)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    refuse_unwritable(p, "--json", args.json)
    try:
        return _measure(args, argv, names)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {flag_message(e, p._option_string_actions)}", file=sys.stderr)
        return 2


def _measure(args, argv: list[str] | None, names: list[str]) -> int:
    """main's body after the flags are checked: load, run every task side by side, report."""
    import torch

    from blockdraft.drafters import resolve_draft
    from blockdraft.llm import LLM
    from blockdraft.model_loader import load_target
    from blockdraft.preflight import resolve_device
    from blockdraft.runner.setup import check_batch_invariant, check_fp32_lm_head
    from blockdraft.sampling_params import SamplingParams
    from blockdraft.side_by_side import compare_engines
    from blockdraft.structured.params import StructuredOutputsParams

    draft = resolve_draft(args.draft, args.model, cache_dir=args.cache_dir)
    device = resolve_device(args.device)
    check_fp32_lm_head(args.enable_fp32_lm_head, device)  # before the target loads
    check_batch_invariant(args.batch_invariant, device)
    target = load_target(args.model, args.dtype, device=device, cache_dir=args.cache_dir)
    pool = dict(num_kv_blocks=128, kv_block_size=16, device=device)
    head = dict(enable_fp32_lm_head=args.enable_fp32_lm_head, batch_invariant=args.batch_invariant)  # not the fp32 judge
    engines = {PLAIN: LLM(target=target, **pool, **head),
               DFLASH: LLM(target=target, draft=draft, num_speculative_tokens=args.num_speculative_tokens,
                           draft_vocab_size=args.draft_vocab_size, **pool, **head)}
    runs, grammar_s, steps = {}, {}, {}
    for name, prompt, fields in (t for t in TASKS if t[0] in names):
        params = SamplingParams(max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(**fields))
        chat = [{"role": "user", "content": prompt}]
        for engine in engines.values():  # untimed: the grammar's one-time compile and oneDNN's first shapes
            engine.generate([chat], dataclasses.replace(params, max_tokens=8))
        grammar_s[name], steps[name] = {PLAIN: 0.0, DFLASH: 0.0}, {PLAIN: 0, DFLASH: 0}
        timers = {label: GrammarTimer() for label in engines}
        timed = {label: _counting(engine, timers[label], steps[name], label) for label, engine in engines.items()}
        runs[name] = {label: rs[0] for label, rs in compare_engines(
            timed, [chat], params, args.repeats, warmup_tokens=0).items()}
        for label, timer in timers.items():
            grammar_s[name][label] = timer.seconds
        print(f"  {name}: done", file=sys.stderr, flush=True)
    rows = task_rows(runs, grammar_s, steps)
    if any(r["divergence"] is None and not r["identical"] for r in rows):
        target_fp32 = None if target.dtype == torch.float32 else load_target(
            args.model, "float32", device=device, cache_dir=args.cache_dir)
        llm_fp32 = None if target_fp32 is None else LLM(target=target_fp32, **pool)
        judge_divergences(rows, runs, engines[PLAIN], llm_fp32)
        del llm_fp32, target_fp32
    pooled = _pooled(runs)
    k = engines[DFLASH].speculator.num_speculative_tokens
    print(f"{args.model} ({target.dtype}, {device}), drafter {draft}, K = {k}, {args.repeats} repeat{'s' if args.repeats > 1 else ''} (medians), "
          f"{torch.get_num_threads()} threads")
    print("| task | tokens | plain tok/s | DFlash tok/s | acceptance length | speedup | identical | follows | "
          "grammar ms/step plain / DFlash |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tau = "n/a" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        g = r["grammar_ms_per_step"]
        print(f"| {r['task']} | {r['tokens']} | {r['plain_tokens_per_s']:.1f} | {r['dflash_tokens_per_s']:.1f} | {tau} | "
              f"{r['speedup']:.2f}x | {_identical_tag(r)} | {r['follows']} | {g[PLAIN]:.2f} / {g[DFLASH]:.2f} |")
    tau = "n/a" if pooled["acceptance_length"] is None else f"{pooled['acceptance_length']:.2f}"
    print(f"| all (pooled) | {pooled['tokens']} | {pooled['plain_tokens_per_s']:.1f} | "
          f"{pooled['dflash_tokens_per_s']:.1f} | {tau} | {pooled['speedup']:.2f}x | "
          f"{all(r['identical'] for r in rows)} | {all(r['follows'] for r in rows)} | |")
    if not all(r["follows"] for r in rows):
        print("follows False: the plain answer breaks its constraint or did not end with 'stop' (an answer cut by "
              "--max-tokens is incomplete)")
    if not all(r["identical"] for r in rows):
        print("identical 'False (tie, gap g; fp32 gap f, fp32 = dflash)': the first divergent token's two candidates "
              "differ by g nats (< 1e-2: a near-tie; bf16 logits of 16-32 are 0.125 apart), f on the target "
              "loaded in float32, which picks DFlash's token or plain's (bench.near_ties)")
    if args.json:
        evidence = {
            "measured": datetime.date.today().isoformat(),
            "command": "python -m blockdraft.bench.structured " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "machine": (torch.cuda.get_device_name() if device == "cuda"
                        else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"),
            "target": args.model, "drafter": str(draft), "num_speculative_tokens": k,
            "draft_vocab_size": args.draft_vocab_size,  # None: the size the drafter's speculative.json records
            "dtype": str(target.dtype).replace("torch.", ""), "device": device, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "pooled": pooled, "tasks": rows,
            "seconds": {n: {label: r.seconds for label, r in rs.items()} for n, rs in runs.items()},
        }
        Path(args.json).write_text(json.dumps(evidence, indent=1))
    return 0 if all(passes(r) for r in rows) else 1


def passes(row: dict) -> bool:
    """Whether a task row (task_rows, judged by judge_divergences) passes: every repeat of both
    engines gave the same answer, and DFlash's equals plain decoding's or first differs at a
    near-tie (bf16 rounding, issue 5) and still follows its constraint (a token the grammar
    refuses is never a tie)."""
    if not row["deterministic"]:
        return False
    if row["identical"]:
        return True
    return bool((row["divergence"] or {}).get("near_tie")) and row["dflash_follows"] is not False


def judge_divergences(rows: list[dict], runs: dict, llm, llm_fp32=None) -> None:
    """Give each row whose DFlash answer diverges from plain decoding's a "divergence" (in place).

    Args:
        rows: task_rows(runs, ...) output; rows with identical token ids are left alone.
        runs: {task: {PLAIN / DFLASH: TimedRun}} whose outputs have `prompt_token_ids` and `token_ids`.
        llm: a plain LLM over the target (the bench's plain engine).
        llm_fp32: a plain LLM over the target loaded in float32, or None.
    Sets row["divergence"] to bench.near_ties.divergence_gaps' dict for the first divergent token,
    judged with constrained=True (the grammar masked every other token).
    """
    from blockdraft.bench.measure import compare_outputs
    from blockdraft.bench.near_ties import divergence_gaps

    for r in rows:
        plain, spec = runs[r["task"]][PLAIN].output, runs[r["task"]][DFLASH].output
        first = compare_outputs([spec.token_ids], [plain.token_ids])["first_mismatch"]
        gaps = divergence_gaps(llm, [list(plain.prompt_token_ids)], [spec.token_ids], [plain.token_ids], first,
                               llm_fp32, constrained=True)
        if gaps:
            r["divergence"] = gaps[0]


def _identical_tag(row: dict) -> str:
    """"True", "False", or for a judged divergence "False (tie|gap g[; fp32 gap f, fp32 = dflash|plain])"."""
    d = row["divergence"]
    if row["identical"] or d is None:
        return str(row["identical"])
    tag = f"False ({'tie, ' if d['near_tie'] else ''}gap {d['pair_gap']:.3g}"
    if "fp32_picks" in d:
        picks = {"candidate": "dflash", "reference": "plain"}[d["fp32_picks"]]
        tag += f"; fp32 gap {d['pair_gap_fp32']:.3g}, fp32 = {picks}"
    return tag + ")"


def _counting(engine, timer: GrammarTimer, steps: dict, label: str):
    """`engine` whose `generate` runs inside `timer` and adds its engine steps to steps[label]."""
    class Counted:
        def generate(self, prompts, params):
            before = engine.engine.stats.num_steps
            with timer:
                out = engine.generate(prompts, params)
            steps[label] += engine.engine.stats.num_steps - before
            return out
    return Counted()


def _pooled(runs: dict) -> dict:
    """Totals over tasks: tokens, tok/s (sum of tokens / sum of median seconds), acceptance length
    over all verify steps, speedup (sum of plain medians / sum of DFlash medians)."""
    plain = [rs[PLAIN] for rs in runs.values()]
    spec = [rs[DFLASH] for rs in runs.values()]
    tokens = sum(r.output.num_output_tokens for r in plain)
    steps = sum(r.output.spec.num_steps for r in spec)
    accepted = sum(r.output.spec.num_accepted_tokens for r in spec)
    plain_s, spec_s = sum(r.median_seconds for r in plain), sum(r.median_seconds for r in spec)
    return {"tokens": tokens, "plain_tokens_per_s": tokens / plain_s, "dflash_tokens_per_s": tokens / spec_s,
            "acceptance_length": (accepted + steps) / steps if steps else None, "speedup": plain_s / spec_s}


if __name__ == "__main__":
    sys.exit(main())
