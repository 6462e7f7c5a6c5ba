"""Per-step host (Python) overhead of the engine, measured on the CPU with a near-free model.

On the GPU path the target and drafter forwards replay CUDA graphs, so for small models the step
time is set by the Python work around them: scheduling, building and staging inputs, sampling and
verification bookkeeping, output assembly, stop checks, detokenization. This benchmark makes the
model nearly free (1 target layer, hidden 64, vocab 1024, random weights, float32 on the CPU) and
runs the code path the GPU runs (the sync-free "dense" attention backend and the padded
CUDA-graph step code run eagerly, graph_mode="eager"), then reports microseconds per engine step:

  step_us: wall time of `LLM.generate` / engine steps (prefill included).
  model_us: the time inside the model forwards, which a GPU runs on the device: the static-graph
      functions (the target forward + LM head + greedy argmax, and the step's tail: verification,
      the drafter block and output packing; replayed as graphs) and the eager target forward and
      draft proposal of steps that no graph fits (prefill, mixed steps).
  host_us: step_us minus model_us: the per-step Python work that stays on the GPU path (plus the
      eager sampling / verification ops of eager steps, which the GPU launches too);
      host_us_per_token divides it by the tokens a step emits (plain decoding: by the requests
      that sampled).

Cases: batch 1 and 32, plain decoding, DFlash with K drafts (random drafter: ~0 accepted, one
token per step) and forced-acceptance DFlash (bench/forced.py: ~K+1 tokens per step, so the
per-token commit work shows). By default a case is one batch of `batch` requests decoded together.
With `--requests N` it is N requests with at most `batch` running at once (max_num_seqs), prompts
of 1/2 to 2x --prompt-len tokens and 1/2 to 1x --max-tokens each: requests finish at different
steps and waiting ones are admitted as they do, so most steps mix prefill and decode rows and run
eagerly (the serving / data-generation regime; e.g. `--mode plain --batch 512 --requests 2000`).
It is a benchmark, not a test:

    python -m blockdraft.bench.host_overhead [--out host.json] [--profile dflash-forced/32] [--max-model-len 32768]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import sys
import time
from dataclasses import replace

import torch

from blockdraft.bench.engines import DFLASH, FORCED, PLAIN, Generation
from blockdraft.bench.shapes import SHAPES, model_config
from blockdraft.errors import refuse_unwritable

# The CPU smoke shape cut down further (2 layers, vocab 1024): the forward costs next to nothing.
HOST_SHAPE = replace(
    SHAPES["tiny"],
    name="host",
    hf_fields={**SHAPES["tiny"].hf_fields, "num_hidden_layers": 2, "max_position_embeddings": 256, "vocab_size": 1024},
    draft_layers=1,
    description="near-free Qwen3 for host-overhead runs: hidden 64, 2 layers, vocab 1024",
)
MODES = (PLAIN, DFLASH, FORCED)


def host_shape(max_model_len: int = 256):
    """HOST_SHAPE with a context of `max_model_len` tokens: the GPU path's static block table is
    ceil(max_model_len / 16) pages wide whatever the requests use (Qwen2.5: 32,768 -> 2,048).

    Raises:
        ValueError: max_model_len < 1 (names the flag and the value).
    """
    if max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {max_model_len}")
    return replace(HOST_SHAPE, hf_fields={**HOST_SHAPE.hf_fields, "max_position_embeddings": max_model_len})
PATHS = {
    # the GPU path's code (sync-free backend, padded static-shape steps), run eagerly on the CPU
    "graph": {"attention_backend": "dense", "graph_mode": "eager"},
    # the CPU default (torch reference backend with host metadata, no graphs)
    "cpu": {},
}


class ModelClock:
    """Accumulates seconds spent in model forwards: StaticGraph calls (the parts a GPU replays as
    graphs) and the runner's eager target forward and draft proposal (steps no graph fits)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def installed(self):
        """Time StaticGraph.__call__ and ModelRunner._forward / _propose (eager steps only) for the
        duration of the block."""
        from blockdraft.runner.model_runner import ModelRunner
        from blockdraft.runner.static_graph import StaticGraph

        patches = [(StaticGraph, "__call__", self._timed), (ModelRunner, "_forward", self._timed),
                   (ModelRunner, "_propose", self._timed)]
        originals = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
        for cls, name, wrap in patches:
            setattr(cls, name, wrap(getattr(cls, name)))
        try:
            yield self
        finally:
            for cls, name, fn in originals:
                setattr(cls, name, fn)

    def _timed(self, fn):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0

        return call


def build_engines(max_batch: int, prompt_len: int, max_tokens: int, k: int, path: str, seed: int = 0,
                  max_model_len: int = 256) -> dict:
    """{mode: OurEngine} over one random target (and drafter) of `host_shape(max_model_len)` on the CPU.

    The forced engine replays the plain continuation of prompt 0, so its batches must be copies
    of that prompt (see `prompts_for`).
    """
    from blockdraft.bench.engines.ours import OurEngine, PoolPlan, dflash_speculator, forced_speculator
    from blockdraft.bench.random_weights import IdTokenizer, init_random_, random_drafter_on_device
    from blockdraft.bench.workload import random_prompts
    from blockdraft.model_loader import LoadedTarget
    from blockdraft.models import build_model

    shape = host_shape(max_model_len)
    config = model_config(shape)
    model = init_random_(build_model(config, dtype=torch.float32, device="cpu"), seed).eval()
    target = LoadedTarget(config, model, IdTokenizer(), "<random host>")
    drafter = random_drafter_on_device(config, shape.draft_layers, k + 1, torch.float32, "cpu", seed + 1)
    plan = PoolPlan(max_batch, prompt_len, max_tokens, lookahead=k + 1)
    options = PATHS[path]
    plain = OurEngine(target, "cpu", plan, options=options)
    prompt = random_prompts(1, prompt_len, config.vocab_size, seed)[0]
    reference = plain.generate([prompt], max_tokens).token_ids[0]
    return {
        PLAIN: plain,
        DFLASH: OurEngine(target, "cpu", plan, dflash_speculator(drafter, target, plan, k), DFLASH, options),
        FORCED: OurEngine(
            target, "cpu", plan, forced_speculator(drafter, target, plan, k, prompt + reference, "cpu"), FORCED,
            options,
        ),
        "_prompts": random_prompts(max_batch, prompt_len, config.vocab_size, seed + 7),
        "_forced_prompt": prompt,
    }


def prompts_for(engines: dict, mode: str, batch: int) -> list[list[int]]:
    """`batch` prompts for `mode`: copies of the reference prompt for forced acceptance."""
    if mode == FORCED:
        return [list(engines["_forced_prompt"]) for _ in range(batch)]
    return engines["_prompts"][:batch]


def stream_for(engines: dict, mode: str, num_requests: int, prompt_len: int, max_tokens: int,
               seed: int = 11) -> tuple[list[list[int]], list[int]]:
    """`num_requests` prompts of prompt_len // 2 .. 2 * prompt_len random tokens (forced acceptance:
    copies of the reference prompt) and a max_tokens each in max_tokens // 2 .. max_tokens, seeded."""
    from blockdraft.bench.workload import random_prompts

    rng = random.Random(seed)
    limits = [rng.randint(max(1, max_tokens // 2), max_tokens) for _ in range(num_requests)]
    if mode == FORCED:
        return [list(engines["_forced_prompt"]) for _ in range(num_requests)], limits
    vocab = model_config(HOST_SHAPE).vocab_size
    full = random_prompts(num_requests, 2 * prompt_len, vocab, seed)
    return [p[: rng.randint(max(1, prompt_len // 2), 2 * prompt_len)] for p in full], limits


def case_inputs(engines: dict, mode: str, batch: int, num_requests: int, prompt_len: int,
                max_tokens: int) -> tuple[list[list[int]], int | list[int]]:
    """(prompts, max_tokens: one for all or one per prompt) of a case: one batch of `batch`
    prompts, or with num_requests > 0 that many requests (`stream_for`)."""
    if num_requests:
        return stream_for(engines, mode, num_requests, prompt_len, max_tokens)
    return prompts_for(engines, mode, batch), max_tokens


def generate(engine, prompts: list[list[int]], max_tokens: int | list[int]) -> Generation:
    """`engine.generate` (greedy, EOS ignored), with a max_tokens per prompt when given a list."""
    if isinstance(max_tokens, int):
        return engine.generate(prompts, max_tokens)
    from blockdraft.sampling_params import SamplingParams

    before = engine.llm.engine.stats.num_steps
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outs = engine.llm.generate(prompts, params)
    return Generation([list(o.token_ids) for o in outs], engine.llm.engine.stats.num_steps - before)


def measure_case(engine, prompts: list[list[int]], max_tokens: int | list[int]) -> dict:
    """One `generate` call -> {"step_us", "host_us", "model_us", "host_us_per_token", "steps",
    "tokens_per_step", "token_ids"} (us per step unless named otherwise)."""
    clock = ModelClock()
    with clock.installed():
        t0 = time.perf_counter()
        gen = generate(engine, prompts, max_tokens)
        seconds = time.perf_counter() - t0
    steps = gen.num_steps
    tokens = sum(len(t) for t in gen.token_ids)
    return {
        "step_us": seconds / steps * 1e6,
        "model_us": clock.seconds / steps * 1e6,
        "host_us": (seconds - clock.seconds) / steps * 1e6,
        "host_us_per_token": (seconds - clock.seconds) / tokens * 1e6,
        "steps": steps,
        "tokens_per_step": tokens / steps,
        "token_ids": gen.token_ids,
    }


def engine_builder(batches: list[int], max_tokens: int, prompt_len: int, k: int, path: str, num_requests: int,
                   max_model_len: int = 256):
    """batch -> the engines of its cases: one set for all batches (max_num_seqs = the largest), or
    with num_requests one per batch (max_num_seqs = the batch; the pool fits 2x prompt_len prompts)."""
    if num_requests:
        return functools.cache(lambda batch: build_engines(batch, 2 * prompt_len, max_tokens, k, path,
                                                           max_model_len=max_model_len))
    shared = build_engines(max(batches), prompt_len, max_tokens, k, path, max_model_len=max_model_len)
    return lambda batch: shared


def run(batches: list[int], modes: list[str], max_tokens: int, prompt_len: int, k: int, repeats: int,
        path: str, num_requests: int = 0, max_model_len: int = 256) -> list[dict]:
    """Median over `repeats` runs (after one warm-up) of every (mode, batch) case; us per step.

    num_requests > 0: each case runs that many requests, at most `batch` at once (module docstring).
    max_model_len: the target's context in tokens (host_shape).
    """
    engines_for = engine_builder(batches, max_tokens, prompt_len, k, path, num_requests, max_model_len)
    rows = []
    for mode in modes:
        for batch in batches:
            engine = engines_for(batch)[mode]
            prompts, limits = case_inputs(engines_for(batch), mode, batch, num_requests, prompt_len, max_tokens)
            generate(engine, prompts, limits)  # warm-up
            runs = [measure_case(engine, prompts, limits) for _ in range(repeats)]
            row = {"case": f"{mode}/{batch}", "mode": mode, "batch": batch, "requests": len(prompts), "path": path}
            for key in ("step_us", "host_us", "model_us", "host_us_per_token", "tokens_per_step"):
                row[key] = statistics.median(r[key] for r in runs)
            row["steps"] = runs[0]["steps"]
            row["output_digest"] = hash(tuple(tuple(t) for t in runs[0]["token_ids"])) & 0xFFFFFFFF
            rows.append(row)
    return rows


def profile_case(case: str, max_tokens: int, prompt_len: int, k: int, path: str, num_requests: int = 0,
                 top: int = 30, max_model_len: int = 256) -> str:
    """cProfile one `generate` of `case` ("mode/batch") -> the top functions by tottime and cumtime."""
    mode, batch = case.split("/")
    engines = engine_builder([int(batch)], max_tokens, prompt_len, k, path, num_requests,
                             max_model_len)(int(batch))
    prompts, limits = case_inputs(engines, mode, int(batch), num_requests, prompt_len, max_tokens)
    generate(engines[mode], prompts, limits)
    prof = cProfile.Profile()
    prof.enable()
    generate(engines[mode], prompts, limits)
    prof.disable()
    buf = io.StringIO()
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
    return buf.getvalue()


def format_table(rows: list[dict]) -> str:
    """A fixed-width table: case, requests, steps, tokens/step, step / host / model us per step,
    host us per token."""
    lines = [f"{'case':<18}{'reqs':>6}{'steps':>7}{'tok/step':>10}{'step us':>10}{'host us':>10}{'model us':>10}"
             f"{'host us/tok':>13}"]
    for r in rows:
        lines.append(
            f"{r['case']:<18}{r['requests']:>6}{r['steps']:>7}{r['tokens_per_step']:>10.2f}{r['step_us']:>10.0f}"
            f"{r['host_us']:>10.0f}{r['model_us']:>10.0f}{r['host_us_per_token']:>13.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m blockdraft.bench.host_overhead`: print the table (us per engine step), write JSON
    with --out; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--path", choices=list(PATHS), default="graph",
                   help="graph: the GPU path's code run eagerly (default); cpu: the CPU default path")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps op overhead steady)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per case, at most BATCH at once (mixed prefill + decode steps); 0: one batch")
    p.add_argument("--profile", metavar="MODE/BATCH", help="print a cProfile of one case instead")
    p.add_argument("--max-model-len", type=int, default=256,
                   help="the target's context in tokens, which sets the block tables' width on the GPU path "
                        "(default 256; Qwen2.5's is 32768)")
    args = p.parse_args(argv)
    try:
        host_shape(args.max_model_len)
    except ValueError as e:
        p.error(str(e))
    refuse_unwritable(p, "--out", args.out)  # before the run, not when writing its result
    torch.set_num_threads(args.threads)
    if args.profile:
        print(profile_case(args.profile, args.max_tokens, args.prompt_len, args.num_speculative_tokens, args.path,
                           args.requests, max_model_len=args.max_model_len))
        return 0
    rows = run(args.batch, args.mode, args.max_tokens, args.prompt_len, args.num_speculative_tokens, args.repeats,
               args.path, args.requests, args.max_model_len)
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": host_shape(args.max_model_len).hf_fields, "max_tokens": args.max_tokens,
                       "prompt_len": args.prompt_len,
                       "k": args.num_speculative_tokens, "requests": args.requests, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
