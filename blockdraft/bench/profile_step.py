"""Where a decode step's time goes: torch.profiler over N engine steps, plain and DFlash.

`blockdraft bench` reports milliseconds per step; this explains them. It builds the engines the
bench builds for `--shape` (bench.workload.random_workload + bench.suite.build_engines: the same
random weights on the device, KV pool, CUDA graphs and random DFlash drafter, B = 16, K = 15),
warms each engine up with one full `generate` over the same context range, then drives one batch
of requests step by step: prefill, --warmup steps, --steps steps timed without the profiler,
--steps steps under torch.profiler. Steps are `LLMEngine.step`, as in `LLM.generate`; one step
is one target forward (plain) or verify + draft + bookkeeping (DFlash), as in the bench's ms/step.

Per mode it prints totals per engine step, then tables (per step, grouped by shortened name):
  wall_ms         device-synchronised wall time of an unprofiled step (ms).
  sync_wall_ms    the same with async scheduling off (host read-back between steps), when it is on.
  profiled_wall_ms  the same under the profiler (ms; the profiler slows the host side).
  busy_ms         union of the GPU activity intervals (kernels, memcpy, memset) of a profiled step (ms).
  idle_ms         wall_ms - busy_ms: host work the GPU waits on, launch gaps (ms).
  kernels         GPU kernels (memcpy_memset: copies and fills), graph_launches (cudaGraphLaunch),
                  eager_launches (cudaLaunchKernel / cuLaunchKernel*), host_syncs (*Synchronize calls).
  tokens          tokens committed per step, all requests together.
  floor_ms        the bench's HBM floor of a step (weights read once at 4.25e12 B/s, H200); wall_over_floor.
  kernel table    kernel name, launches per step, GPU us per step, % of GPU time; then the host ops by
                  self CPU time (same columns; cudaStreamSynchronize there is the host waiting on the GPU).
On the CPU (no CUDA activity) the one table lists CPU ops by self time: busy_ms = time inside ops,
idle_ms = the Python work between them (can read < 0: the profiler's own cost lands in op time).

    python -m blockdraft.bench.profile_step --shape qwen3-8b --batch-size 1 --steps 20 --out prof.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from blockdraft.bench.engines import DFLASH, PLAIN
from blockdraft.bench.measure import synchronize
from blockdraft.bench.shapes import H200_HBM_BYTES_PER_S, SHAPES
from blockdraft.errors import refuse_unwritable

SCHEMA = "blockdraft-profile-step/1"
STEP_LABEL = "blockdraft::engine_step"  # record_function around each step (marks steps in the trace)
BLOCK_SIZE = 16  # the bench's --block-size default: K = 15 drafts per step


def shorten(name: str, width: int = 60) -> str:
    """A kernel name without `void`, namespaces and parameter list, cut to `width` characters
    ("void at::native::reduce_kernel<512, 1, ...>(...)" -> "reduce_kernel<512, 1, ...>")."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = " ".join(re.sub(r"\b\w+::", "", name).split())
    return name if len(name) <= width else name[: width - 3] + "..."


def group(pairs, steps: int) -> list[dict]:
    """(name, us) pairs -> rows {name, count_per_step, us_per_step, pct}, most time first."""
    acc: dict[str, list] = {}
    for name, us in pairs:
        a = acc.setdefault(name, [0, 0.0])
        a[0], a[1] = a[0] + 1, a[1] + us
    total = sum(us for _, us in acc.values()) or 1.0
    rows = [{"name": n, "count_per_step": c / steps, "us_per_step": us / steps, "pct": 100 * us / total}
            for n, (c, us) in acc.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us): time with at least one activity running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(events, steps: int, cuda: bool) -> dict:
    """Per-step totals and tables from a profiler's events (see the module doc for the keys)."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    spans = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == STEP_LABEL]
    # host work inside the steps (not the clock's synchronize around them)
    host = [e for e in cpu if e.name != STEP_LABEL and any(a <= e.time_range.start < b for a, b in spans)]
    # GPU activity: kernels, memcpy, memset; not the GPU-side copies of record_function ranges
    # (Kineto's gpu_user_annotation events span a whole step)
    dev = [e for e in events if e.device_type == DeviceType.CUDA and e.name != STEP_LABEL
           and not getattr(e, "is_user_annotation", False)] if cuda else []
    host_rows = group(((e.name, e.self_cpu_time_total) for e in host), steps)
    copies = sum(e.name.startswith(("Memcpy", "Memset")) for e in dev)

    def per_step(pred) -> float:
        return sum(1 for e in host if pred(e.name)) / steps

    if cuda:
        rows = group(((shorten(e.name), e.time_range.elapsed_us()) for e in dev), steps)
        busy_us = union_us([(e.time_range.start, e.time_range.end) for e in dev])
    else:
        rows, busy_us = host_rows, sum(e.self_cpu_time_total for e in host)
    return {
        "timeline": "cuda" if cuda else "cpu",
        "busy_ms": busy_us / steps / 1e3,
        "device_time_ms": sum(r["us_per_step"] for r in rows) / 1e3,
        "kernels": (len(dev) - copies) / steps,
        "memcpy_memset": copies / steps,
        "graph_launches": per_step(lambda n: n.startswith("cudaGraphLaunch")),
        "eager_launches": per_step(lambda n: n.startswith(("cudaLaunchKernel", "cuLaunchKernel"))),
        "host_syncs": per_step(lambda n: "Synchronize" in n),
        "rows": rows,
        "host_rows": host_rows if cuda else None,
    }


def _timed_steps(llm_engine, steps: int, device: torch.device) -> float:
    """Seconds for `steps` engine steps, the clock started and stopped on an idle device."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        with record_function(STEP_LABEL):
            llm_engine.step(stream=False)
    synchronize(device)
    return time.perf_counter() - t0


def profile_mode(engine, prompts: list[list[int]], max_tokens: int, steps: int, warmup: int,
                 device: torch.device, trace: str | None = None) -> dict:
    """Warm up `engine` (a bench OurEngine), then time and profile `steps` steps of one batch of
    `prompts` (see the module doc). `max_tokens` must outlast prefill + warmup + 3 x steps + 1 at K + 1
    tokens per step, so that no request finishes. Returns `summarize`'s dict plus steps, batch_size,
    wall_ms, profiled_wall_ms, idle_ms, tokens; writes the chrome trace to `trace` if given."""
    from blockdraft.sampling_params import SamplingParams

    engine.generate(prompts, warmup + 3 * steps + 3)  # compiles kernels, fills caches over the same contexts
    llm = engine.llm.engine
    ids = [f"profile-{engine.mode}-{i}" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in zip(ids, prompts):
        llm.add_request(rid, prompt, params)
    _timed_steps(llm, 1 + warmup, device)  # prefill + warm-up steps
    wall = _timed_steps(llm, steps, device)
    sync_wall = None
    if llm.async_scheduling:  # the same steps with the host read-back between them, for the ratio
        llm.async_scheduling = False
        _timed_steps(llm, 1, device)  # reads back the step launched ahead, untimed
        sync_wall = _timed_steps(llm, steps, device)
        llm.async_scheduling = True
        _timed_steps(llm, 1, device)  # back in the chain of launched-ahead steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    tokens = llm.stats.num_generated_tokens
    with profile(activities=activities) as prof:
        profiled = _timed_steps(llm, steps, device)
    tokens = llm.stats.num_generated_tokens - tokens
    for rid in ids:
        llm.abort_request(rid)
    llm.step(stream=False)  # reports the aborted requests, leaving the engine empty
    if trace:
        prof.export_chrome_trace(trace)
    out = summarize(prof.events(), steps, device.type == "cuda")
    wall_ms = wall / steps * 1e3
    return {"steps": steps, "batch_size": len(prompts), "wall_ms": wall_ms, "profiled_wall_ms": profiled / steps * 1e3,
            "idle_ms": wall_ms - out["busy_ms"], "tokens": tokens / steps, "async_scheduling": llm.async_scheduling,
            "sync_wall_ms": None if sync_wall is None else sync_wall / steps * 1e3, **out}


def trace_path(path: str, mode: str) -> str:
    """`path` with `-<mode>` before its .json / .json.gz suffix ("t.json" -> "t-plain.json")."""
    for suffix in (".json.gz", ".json", ".gz"):
        if path.endswith(suffix):
            return f"{path[: -len(suffix)]}-{mode}{suffix}"
    return f"{path}-{mode}.json"


def run(shape: str, device: str, batch_size: int, steps: int, warmup: int, modes: list[str], prompt_len: int,
        hbm_bandwidth: float = H200_HBM_BYTES_PER_S, trace: str | None = None, on_mode=None,
        draft_vocab_size: int = 0, num_speculative_tokens: int | None = None) -> dict:
    """Build the bench's engines for `shape` and profile each mode; returns the JSON document.
    draft_vocab_size N > 0: the drafter scores ids 0..N-1 only (as `bench --draft-vocab-size N`).
    num_speculative_tokens K: drafts verified per step, 1..BLOCK_SIZE - 1 (None: BLOCK_SIZE - 1); a
    step's cost depends on K (K + 1 verify rows per request), not on how many drafts are accepted.
    `on_mode(doc, mode)` is called as each mode is done (main prints it and rewrites --out, so a
    run cut short keeps what it measured).

    Raises:
        ValueError: no CUDA for device "cuda", prompt + tokens beyond the shape's context, or a draft
            vocabulary larger than the shape's (named).
    """
    from blockdraft.bench.command import device_info, floor_of
    from blockdraft.bench.shapes import get_shape, model_config
    from blockdraft.bench.suite import Settings, build_engines, log
    from blockdraft.bench.workload import random_workload, resolve_device_dtype

    vocab = model_config(get_shape(shape)).vocab_size
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= BLOCK_SIZE - 1:
        raise ValueError(f"--num-speculative-tokens must be in [1, {BLOCK_SIZE - 1}] (the random drafter's block "
                         f"size is {BLOCK_SIZE}), got {num_speculative_tokens}")
    if not 0 <= draft_vocab_size <= vocab:
        raise ValueError(f"--draft-vocab-size must be in [0, {vocab}] for {shape} (0: full vocabulary), "
                         f"got {draft_vocab_size}")
    dev, dtype = resolve_device_dtype(device, "auto")
    log(f"building {shape} on {dev}")
    workload = random_workload(shape, dev, dtype, num_prompts=batch_size, prompt_len=prompt_len, draft_layers=None,
                               block_size=BLOCK_SIZE, with_drafter=DFLASH in modes, draft_vocab_size=draft_vocab_size)
    workload.hf_model = None  # the bench's HF baseline; not profiled here (frees its copy of the weights)
    k = (num_speculative_tokens or BLOCK_SIZE - 1) if workload.drafter is not None else 0
    max_tokens = (1 + warmup + 3 * steps + 2) * (k + 1)  # no request finishes: at most K + 1 tokens a step
    engines, _, _ = build_engines(workload, Settings((batch_size,), max_tokens, engines=("ours",),
                                                     num_speculative_tokens=k or None))
    by_mode = {e.mode: e for e in engines}
    floor = floor_of(workload, hbm_bandwidth)
    doc = {"schema": SCHEMA, "workload": {"shape": shape, "prompt_len": prompt_len, **workload.source},
           "device": device_info(dev), "dtype": str(dtype).replace("torch.", ""),
           "settings": {"batch_size": batch_size, "steps": steps, "warmup": warmup, "modes": modes,
                        "block_size": BLOCK_SIZE if k else None, "num_speculative_tokens": k or None,
                        "draft_vocab_size": draft_vocab_size},
           "floor": floor, "modes": {}}
    for mode in modes:
        log(f"{mode}: warm-up, {steps} timed steps, {steps} profiled steps")
        s = profile_mode(by_mode[mode], workload.prompts, max_tokens, steps, warmup, dev,
                         trace_path(trace, mode) if trace else None)
        s["floor_ms"] = floor["plain_step_floor_ms" if mode == PLAIN else "dflash_step_floor_ms"]
        s["wall_over_floor"] = s["wall_ms"] / s["floor_ms"]
        doc["modes"][mode] = s
        if on_mode is not None:
            on_mode(doc, mode)
    return doc


def format_rows(rows: list[dict], title: str, top: int) -> list[str]:
    """The first `top` rows as fixed-width lines, then one line for the rest."""
    lines = [f"{title:<60} {'n/step':>8} {'us/step':>10} {'%':>6}"]
    for r in rows[:top]:
        lines.append(f"{r['name'][:60]:<60} {r['count_per_step']:>8.1f} {r['us_per_step']:>10.1f} {r['pct']:>6.1f}")
    rest = rows[top:]
    if rest:
        lines.append(f"{f'({len(rest)} more)':<60} {sum(r['count_per_step'] for r in rest):>8.1f} "
                     f"{sum(r['us_per_step'] for r in rest):>10.1f} {sum(r['pct'] for r in rest):>6.1f}")
    return lines


def format_mode(mode: str, s: dict, top: int) -> str:
    """One mode's totals and tables (milliseconds and microseconds per engine step)."""
    cuda = s["timeline"] == "cuda"
    lines = [
        f"== {mode}: {s['steps']} steps, batch {s['batch_size']}, {s['tokens']:.2f} tokens/step ({s['timeline']})",
        f"wall {s['wall_ms']:.3f} ms/step (profiled {s['profiled_wall_ms']:.3f})"
        + (f" | async scheduling off: {s['sync_wall_ms']:.3f}" if s.get("sync_wall_ms") is not None else "")
        + (f" | HBM floor {s['floor_ms']:.3f} ms, wall/floor {s['wall_over_floor']:.2f}" if cuda else ""),
        f"{'GPU' if cuda else 'CPU op'} busy {s['busy_ms']:.3f} ms/step | idle (wall - busy) "
        f"{s['idle_ms']:.3f} ms/step",
    ]
    if cuda:  # kernels, launches and syncs exist on a CUDA timeline only (the CPU's JSON holds 0)
        lines.append(
            f"kernels {s['kernels']:.1f}/step (+ {s['memcpy_memset']:.1f} memcpy/memset) | graph launches "
            f"{s['graph_launches']:.1f}/step | eager launches {s['eager_launches']:.1f}/step | host syncs "
            f"{s['host_syncs']:.1f}/step")
    lines += format_rows(s["rows"], "GPU kernel" if cuda else "CPU op (self time)", top)
    if cuda:
        lines += format_rows(s["host_rows"], "host op (self CPU time)", top)
    return "\n".join(lines)


def _at_least(low: int):
    """An argparse type: an int >= `low`, else an error naming the value and the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    """`python -m blockdraft.bench.profile_step`: print the tables, write JSON (--out) and chrome
    traces (--trace); returns the exit code (argparse exits with 2 on a bad flag)."""
    # no abbreviations: `--draft shipped` (a flag of other tools) was read as --draft-vocab-size
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog="CPU smoke run: --shape tiny --device cpu --steps 2 --warmup 1 --prompt-len 16")
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="random-weight shape (default qwen3-8b)")
    p.add_argument("--batch-size", type=_at_least(1), default=1, help="concurrent requests (default 1)")
    p.add_argument("--steps", type=_at_least(1), default=20, help="engine steps timed, then profiled (default 20)")
    p.add_argument("--warmup", type=_at_least(0), default=3, help="steps after prefill before timing (default 3)")
    p.add_argument("--mode", default="both", choices=["plain", "dflash", "both"], help="default both")
    p.add_argument("--prompt-len", type=_at_least(1), default=128,
                   help="tokens per random prompt (default 128, as bench)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto (default): cuda if available")
    p.add_argument("--draft-vocab-size", type=_at_least(0), default=0,
                   help="DFlash drafts over ids 0..N-1 of the random vocabulary only, as bench --shape ... "
                        "--draft-vocab-size N: 0 (default: full vocabulary) up to the shape's vocabulary size")
    p.add_argument("--num-speculative-tokens", type=_at_least(1), default=None, metavar="K",
                   help=f"DFlash drafts verified per step, 1..{BLOCK_SIZE - 1} (default {BLOCK_SIZE - 1}, as bench); "
                        "the step's cost depends on K, not on how many drafts are accepted")
    p.add_argument("--top", type=_at_least(1), default=25,
                   help="table rows printed per table (default 25; the JSON has all)")
    p.add_argument("--out", help="write the JSON document here")
    p.add_argument("--trace", help="chrome trace per mode: PATH with -plain / -dflash before .json (.json.gz: gzipped)")
    args = p.parse_args(argv)
    modes = [PLAIN, DFLASH] if args.mode == "both" else [args.mode]
    for flag, path in (("--out", args.out), ("--trace", args.trace)):  # before minutes of building
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                p.error(f"{flag} {path!r}: cannot create its folder ({e.strerror or e})")
            refuse_unwritable(p, flag, path)  # e.g. a folder given for the file

    def on_mode(doc: dict, mode: str) -> None:
        if args.out:  # first: a closed stdout loses no data
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(format_mode(mode, doc["modes"][mode], args.top) + "\n", flush=True)

    try:
        run(args.shape, args.device, args.batch_size, args.steps, args.warmup, modes, args.prompt_len,
            trace=args.trace, on_mode=on_mode, draft_vocab_size=args.draft_vocab_size,
            num_speculative_tokens=args.num_speculative_tokens)
    except ValueError as e:
        p.error(str(e))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
