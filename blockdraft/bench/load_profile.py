"""Where a run under load spends its time: engine steps by the kind of work they launched.

`blockdraft bench --num-prompts M` measures a server's load (at most N requests in flight, the next
sent as one finishes); this explains its number. For plain decoding and DFlash it runs the same
M prompts twice: as closed batches of N (all start together) and as that window (requests start
and stop at different steps), and sorts each `LLMEngine.step` call by what it launched:

  uniform        a decode / verify step that replays the uniform-step CUDA graphs
  continuation   the next such step, launched from the previous one's device output (async scheduling)
  continuation-past-stops  the same, leaving out the requests that stopped (their rows dropped)
  join           a uniform step in which the requests of a prefill step launched ahead join the
                 others, launched before that prefill is read back (async scheduling)
  prefill-graph  a prefill step of up to 8 requests replaying the prefill graphs
  eager          any other step (mixed prefill + decode, a burst of prefills, a chunk, no graphs)
  none           nothing launched (the step only read back the one launched before, or the
                 scheduler had nothing to run)

An engine step that launched two (e.g. "uniform+continuation", a chain restarted after the batch
changed) is its own row. Per row: engine steps, seconds of host wall time in them (the GPU time
shows through the read-back each step waits for), milliseconds each, requests running after it
(mean); the "(all)" row of each run gives its wall time, steps and tokens per second.

    python -m blockdraft.bench.load_profile --model qwen2.5-coder-0.5b-instruct --draft shipped \\
        --draft-vocab-size 32768 --batch-size 32 --num-prompts 128 --max-tokens 128 --out load.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from blockdraft.bench.engines import DFLASH, PLAIN
from blockdraft.bench.measure import synchronize
from blockdraft.engine.feed import feed_requests
from blockdraft.errors import flag_message, refuse_unwritable
from blockdraft.runner.model_runner import ModelRunner
from blockdraft.sampling_params import SamplingParams

SCHEMA = "blockdraft-load-profile/1"
HOWS = ("closed", "windowed")


@contextmanager
def recorded_launches():
    """Yield (kinds, shapes): `kinds` collects the kind of every step any ModelRunner launches in
    the block (the kinds in the module docstring; "continuation-refused" / "join-refused" for a
    step scheduled that way that fit no graph); `shapes` maps "eager" and "prefill-graph" to the
    [requests, rows] of each such launch (what decides whether a prefill step fits a graph)."""
    kinds: list[str] = []
    shapes: dict[str, list[list[int]]] = {"eager": [], "prefill-graph": []}
    launch, continuation, join = ModelRunner.launch, ModelRunner.launch_continuation, ModelRunner.launch_join

    def recorded_launch(self, so):
        step = launch(self, so)
        kind = "uniform" if step.graphed else "prefill-graph" if step.prefill_graphed else "eager"
        kinds.append(kind)
        if kind in shapes:
            shapes[kind].append([len(so.requests), so.total_num_tokens])
        return step

    def recorded_continuation(self, prev, so):
        out = continuation(self, prev, so)
        if out is None:
            kinds.append("continuation-refused")
        else:
            kinds.append("continuation" if len(so.requests) == len(prev.so.requests) else "continuation-past-stops")
        return out

    def recorded_join(self, prev, so):
        out = join(self, prev, so)
        kinds.append("join" if out is not None else "join-refused")
        return out

    ModelRunner.launch, ModelRunner.launch_continuation = recorded_launch, recorded_continuation
    ModelRunner.launch_join = recorded_join
    try:
        yield kinds, shapes
    finally:
        ModelRunner.launch, ModelRunner.launch_continuation, ModelRunner.launch_join = launch, continuation, join


def profile_load(engine, prompts: list[list[int]], max_tokens: int, batch_size: int, how: str,
                 device: torch.device | str = "cpu") -> dict:
    """Run `prompts` greedily (ignore_eos, `max_tokens` each) through `engine` (an LLMEngine) and
    sort its steps by kind.

    how: "closed" = batches of `batch_size` prompts, each started together and run to the end;
    "windowed" = at most `batch_size` in the engine, the next added as one finishes. device: the
    engine's (CUDA is synchronised before and after the timed run).
    Returns {"wall_s", "tokens", "tokens_per_s", "steps", "by_kind": {kind: {"steps", "seconds",
    "ms_each", "mean_running"}}, "launch_shapes": {"eager" | "prefill-graph": [[requests, rows],
    ...] in launch order}} (seconds: host wall time, the device synchronised at both ends).
    Raises:
        ValueError: `how` not in HOWS, batch_size < 1, or a prompt the engine refuses.
    """
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    steps: list[tuple[float, str, int]] = []
    plain_step = engine.step

    with recorded_launches() as (kinds, shapes):
        def timed_step(stream: bool = True):
            first, t0 = len(kinds), time.perf_counter()
            out = plain_step(stream)
            steps.append((time.perf_counter() - t0, "+".join(kinds[first:]) or "none", len(engine.scheduler.running)))
            return out

        engine.step = timed_step
        try:
            synchronize(device)
            t0 = time.perf_counter()
            if how == "closed":
                outs = []
                for start in range(0, len(prompts), batch_size):
                    chunk = prompts[start:start + batch_size]
                    outs += feed_requests(engine, chunk, params, len(chunk), id_prefix="load")
            else:
                outs = feed_requests(engine, prompts, params, batch_size, id_prefix="load")
            synchronize(device)
            wall = time.perf_counter() - t0
        finally:
            del engine.step  # the instance attribute shadowed the method
    by_kind: dict = collections.defaultdict(lambda: [0, 0.0, 0])
    for seconds, kind, running in steps:
        row = by_kind[kind]
        row[0], row[1], row[2] = row[0] + 1, row[1] + seconds, row[2] + running
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": len(steps),
        "by_kind": {k: {"steps": n, "seconds": s, "ms_each": 1e3 * s / n, "mean_running": r / n}
                    for k, (n, s, r) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "launch_shapes": shapes,
    }  # fmt: skip


def format_table(results: dict) -> str:
    """The table of `profile_load` results keyed "mode/how": one "(all)" line per run (its steps,
    wall seconds, ms per step, output tokens per second), then one line per step kind (steps,
    seconds of host wall time, ms each, mean requests running after the step), then the
    requests x rows of its first 12 eager launches, if any (why they missed the prefill graphs)."""
    lines = [f"{'mode':7} {'how':9} {'kind':32} {'steps':>6} {'seconds':>8} {'ms each':>8} {'running':>7} {'tok/s':>9}"]
    for key, r in results.items():
        mode, how = key.split("/")
        lines.append(f"{mode:7} {how:9} {'(all)':32} {r['steps']:6d} {r['wall_s']:8.3f} "
                     f"{1e3 * r['wall_s'] / max(r['steps'], 1):8.3f} {'':7} {r['tokens_per_s']:9.1f}")
        for kind, k in r["by_kind"].items():
            lines.append(f"{'':7} {'':9} {kind:32} {k['steps']:6d} {k['seconds']:8.3f} {k['ms_each']:8.3f} "
                         f"{k['mean_running']:7.1f}")
        eager = r.get("launch_shapes", {}).get("eager", [])
        if eager:
            shown = ", ".join(f"{n}x{t}" for n, t in eager[:12]) + (", ..." if len(eager) > 12 else "")
            lines.append(f"{'':7} {'':9} eager launches, requests x rows: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m blockdraft.bench.load_profile`: print the table, write JSON (--out); returns the
    exit code (argparse exits with 2 on a bad flag, naming it)."""
    from blockdraft.bench.engines.ours import OurEngine, PoolPlan, dflash_speculator
    from blockdraft.bench.workload import model_workload, resolve_device_dtype
    from blockdraft.cpu_threads import add_threads_flag, apply_threads_flag
    from blockdraft.drafters import AUTO, SHIPPED, resolve_draft
    from blockdraft.engine.scheduler import check_admission_settings
    from blockdraft.engine_args import add_admission_flags, add_draft_vocab_size_flag, add_mixed_prefill_flag
    from blockdraft.preflight import preflight

    p = argparse.ArgumentParser(prog="python -m blockdraft.bench.load_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name or HF folder (default %(default)s)")
    p.add_argument("--draft", default="shipped", help="DFlash drafter folder, or 'shipped' (default) for --model's")
    add_draft_vocab_size_flag(p)
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts per step, 1..B-1 (default: the K `blockdraft generate` uses for the drafter on this "
                        "device type, recorded in its speculative.json; B - 1 where it records none)")
    p.add_argument("--dataset", default="humaneval", choices=["humaneval", "mtbench"], help="prompts (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="requests in flight (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=128,
                   help="requests per run, >= --batch-size (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each of plain/dflash x closed/windowed; the table shows the last, as the first "
                        "compiles kernels for its shapes (default %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto (default): cuda when torch sees a GPU. Meant for the GPU: on the CPU every step is eager")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto (default): bf16 on CUDA, fp32 on the CPU")
    add_mixed_prefill_flag(p)
    add_admission_flags(p)
    add_threads_flag(p)
    p.add_argument("--out", help="write the JSON document here")
    args = p.parse_args(argv)
    for name in ("batch_size", "num_prompts", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_prompts < args.batch_size:
        p.error(f"--num-prompts ({args.num_prompts}) must be >= --batch-size ({args.batch_size}): a window of "
                f"{args.batch_size} needs that many requests")
    refuse_unwritable(p, "--out", args.out)
    apply_threads_flag(p, args.threads)
    try:
        check_admission_settings(args.admission_batch_ratio, args.admission_max_wait_steps)
        device, dtype = resolve_device_dtype(args.device, args.dtype)
        draft = resolve_draft(SHIPPED if args.draft == AUTO else args.draft, args.model)  # a profile of DFlash
        if draft is None:
            p.error(f"--draft {args.draft!r}: no drafter (give a DFlash drafter folder or 'shipped')")
        # the drafter folder, its config against the model's, the draft vocabulary: before the weights load
        pre = preflight(args.model, draft, args.num_speculative_tokens, device=device.type,
                        draft_vocab_size=args.draft_vocab_size)
        _log(f"loading {args.model} and its drafter")
        wl = model_workload(args.model, str(pre.draft), device, dtype, dataset=args.dataset,
                            num_prompts=args.num_prompts, draft_vocab_size=pre.draft_vocab_size, load_hf=False)
    except (ValueError, FileNotFoundError) as e:
        p.error(flag_message(e, p._option_string_actions))
    k = pre.num_speculative_tokens  # the flag, else the drafter's K on this device type, else B - 1 (preflight)
    plan = PoolPlan(max_batch=args.batch_size, max_prompt_len=max(map(len, wl.prompts)), max_tokens=args.max_tokens,
                    lookahead=k + 1)
    options = {name: getattr(args, name) for name in ("mixed_prefill", "admission_batch_ratio", "admission_max_wait_steps")
               if getattr(args, name) is not None}
    results, mixed, admission = {}, {}, {}
    for mode in (PLAIN, DFLASH):
        spec = None if mode == PLAIN else dflash_speculator(wl.drafter, wl.target, plan, k, wl.draft_head)
        engine = OurEngine(wl.target, str(device), plan, spec, mode, options).llm.engine
        mixed[mode] = engine.scheduler.config.mixed_prefill
        admission[mode] = engine.scheduler.config.admission_batch_ratio  # per engine: its default
        for how in HOWS:
            for r in range(args.repeats):
                _log(f"{mode} {how}, run {r + 1}/{args.repeats}: {args.num_prompts} requests, {args.batch_size} "
                     f"at a time")
                results[f"{mode}/{how}"] = profile_load(engine, wl.prompts, args.max_tokens, args.batch_size, how,
                                                        device)
        del engine
    # the flags as given (None: each engine's default) beside the effective values per engine, as bench
    settings = {**vars(args), "mixed_prefill_flag": args.mixed_prefill, "admission_batch_ratio_flag": args.admission_batch_ratio,
                "mixed_prefill": mixed, "admission_batch_ratio": admission, "draft": str(pre.draft),
                "draft_vocab_size": pre.draft_vocab_size, "num_speculative_tokens": k}
    doc = {"schema": SCHEMA, "settings": settings, "device": str(device),
           "dtype": str(dtype).removeprefix("torch."), "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(format_table(results))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _log(msg: str) -> None:
    print(f"[load_profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
