"""The benchmark matrix: every engine at every batch size on one workload, plus output parity.

Engines (when selected and possible): ours plain (the reference every ratio and parity check
uses), ours DFlash, ours DFlash with forced acceptance (bench/forced.py), HF `generate`, and
z-lab `dflash_generate` plain (block_size 1) and DFlash (block_size K + 1) at batch 1.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from blockdraft.bench.engines import DFLASH, FORCED, PLAIN
from blockdraft.bench.measure import Cell, compare_outputs, measure
from blockdraft.bench.workload import Workload
from blockdraft.errors import param_error

ENGINE_CHOICES = ("ours", "hf", "zlab")


@dataclass(frozen=True)
class Settings:
    """Knobs of one benchmark run (see `blockdraft bench --help`)."""

    batch_sizes: tuple[int, ...]
    max_tokens: int
    repeats: int = 3
    warmup: int = 1
    engines: tuple[str, ...] = ENGINE_CHOICES
    forced: bool = False
    num_speculative_tokens: int | None = None
    llm_options: dict | None = None
    num_prompts: int | None = None  # requests per cell (None: the batch size, one closed batch)

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be integers >= 1, got {list(self.batch_sizes)}")
        if self.max_tokens < 2:
            raise param_error("max_tokens", f"max_tokens must be >= 2 (prefill + at least one decode step), got {self.max_tokens}")
        if self.num_prompts is not None and self.num_prompts < max(self.batch_sizes):
            raise param_error("num_prompts", f"num_prompts must be >= every batch size, got {self.num_prompts} with "
                                             f"batch sizes up to {max(self.batch_sizes)}: it is how many requests a "
                                             f"cell sends, up to batch-size at a time")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {self.repeats} and {self.warmup}")
        bad = sorted(set(self.engines) - set(ENGINE_CHOICES))
        if bad or "ours" not in self.engines:
            raise ValueError(f"engines must include 'ours' (the reference) and only {list(ENGINE_CHOICES)}, "
                             f"got {list(self.engines)}")


def cell_prompts(workload: Workload, settings: Settings, batch: int, forced: bool = False) -> list[list[int]]:
    """The prompts of one cell: `settings.num_prompts` (default `batch`) of the workload's, in
    order (cycled when it has fewer); the forced engine repeats prompt 0, whose continuation its
    drafts replay."""
    n = settings.num_prompts or batch
    return [workload.prompts[0 if forced else j % len(workload.prompts)] for j in range(n)]


def log(msg: str) -> None:
    """Progress on stderr with a wall-clock stamp (stdout carries the table)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def num_speculative_tokens(workload: Workload, settings: Settings) -> int | None:
    """K, drafts per step: the setting, else the K `blockdraft generate` / `LLM` use for the drafter
    folder on the workload's device type (its speculative.json, `per_device` entry first;
    resolve_num_speculative_tokens), else block_size - 1 (a folder that records no K, or the
    random drafter of a --shape run, which has no folder). None without a drafter.

    Raises:
        ValueError: bad speculative.json, or K outside [1, block_size - 1] (naming where it came from).
    """
    if workload.drafter is None:
        return None
    folder = workload.source.get("draft")  # model_workload's drafter folder; random_workload has none
    if folder is None:
        return settings.num_speculative_tokens or workload.drafter.config.block_size - 1
    from blockdraft.spec.dflash.checkpoint import resolve_num_speculative_tokens

    return resolve_num_speculative_tokens(settings.num_speculative_tokens, folder, workload.drafter.config,
                                          torch.device(workload.device).type)


def engine_builders(
    workload: Workload, settings: Settings
) -> tuple[list[Callable[[list[int] | None], object]], dict]:
    """(builders of the engines to run, ours plain first; {"engine/mode": reason} for those left out).

    A builder takes the forced prompt's plain continuation (`forced_reference`, needed by the
    forced engine only, else ignored) and returns a BenchEngine.
    """
    from blockdraft.bench.engines.ours import OurEngine, PoolPlan, dflash_speculator, forced_speculator

    skipped: dict[str, str] = {}
    k = num_speculative_tokens(workload, settings)
    plan = PoolPlan(max(settings.batch_sizes), max(len(p) for p in workload.prompts), settings.max_tokens,
                    lookahead=(k or 0) + 1)
    longest = plan.max_prompt_len + plan.max_tokens + plan.lookahead
    if longest > workload.config.max_position_embeddings:
        raise ValueError(f"longest prompt ({plan.max_prompt_len}) + max_tokens ({plan.max_tokens}) + K + 1 exceeds "
                         f"the model's context of {workload.config.max_position_embeddings} positions")
    dev, opts = str(workload.device), settings.llm_options or {}
    builders = [lambda ref: OurEngine(workload.target, dev, plan, options=opts)]
    if workload.drafter is None:
        skipped[f"ours/{DFLASH}"] = "no drafter"
    else:
        builders.append(lambda ref: OurEngine(
            workload.target, dev, plan,
            dflash_speculator(workload.drafter, workload.target, plan, k, workload.draft_head), DFLASH, opts))
        if settings.forced:
            builders.append(lambda ref: OurEngine(
                workload.target, dev, plan,
                forced_speculator(workload.drafter, workload.target, plan, k, workload.prompts[0] + ref, dev,
                                  workload.draft_head),
                FORCED, opts))
    if "hf" in settings.engines:
        from blockdraft.bench.engines.hf import HFEngine

        builders.append(lambda ref: HFEngine(workload.hf_model, workload.pad_token_id))
    if "zlab" in settings.engines:
        builders += [(lambda ref, e=e: e) for e in _zlab_engines(workload, k, skipped)]
    return builders, skipped


def forced_reference_of(plain, workload: Workload, settings: Settings) -> list[int] | None:
    """The plain continuation of prompt 0 (batch 1) that the forced engine's drafts replay, or None
    when the run has no forced engine."""
    if not settings.forced or workload.drafter is None:
        return None
    return plain.generate([workload.prompts[0]], settings.max_tokens).token_ids[0]


def build_engines(workload: Workload, settings: Settings) -> tuple[list, dict, list[int] | None]:
    """All engines of `engine_builders` at once -> (engines, skipped, forced reference); for tools
    that switch between engines (profile_step). `run_matrix` builds them one at a time instead."""
    builders, skipped = engine_builders(workload, settings)
    engines = [builders[0](None)]
    reference = forced_reference_of(engines[0], workload, settings)
    engines += [build(reference) for build in builders[1:]]
    return engines, skipped, reference


def _zlab_engines(workload: Workload, k: int | None, skipped: dict) -> list:
    if workload.drafter is None:
        skipped["zlab"] = "no drafter (z-lab's loop needs one, even for block_size 1)"
        return []
    try:
        from blockdraft.bench.engines.zlab import ZLabEngine
        from blockdraft.bench.random_weights import zlab_drafter_from

        zl = zlab_drafter_from(workload.drafter)
    except ImportError as e:
        skipped["zlab"] = f"z-lab reference not importable ({e}); install dflash==0.1.0"
        return []
    return [ZLabEngine(zl, workload.hf_model, 1), ZLabEngine(zl, workload.hf_model, k + 1)]


def run_matrix(
    workload: Workload, settings: Settings, on_engine: Callable[[list[Cell], list[dict], dict], None] | None = None
):
    """Measure every engine at every batch size; returns (cells, parity, skipped), cells and
    parity rows in batch-size order.

    Engines are built one at a time: each is measured at every batch size, then dropped before the
    next is built, so no engine shares the process (or the GPU's memory) with another, as in a
    server (docs/benchmarks/gpu.md "Session 10" on how much a host-bound step varies with what
    else ran in the process).
    parity rows compare, per batch size: ours DFlash vs ours plain, HF vs ours plain, z-lab plain
    vs ours plain, z-lab DFlash vs z-lab plain; the forced rows compare against ours plain's
    output for the shared forced prompt. `on_engine(cells, parity, skipped)` is called after each
    engine (the CLI rewrites its JSON there, so a run cut short keeps what it measured).
    """
    builders, skipped = engine_builders(workload, settings)
    by_batch: dict[int, dict[tuple[str, str], Cell]] = {b: {} for b in settings.batch_sizes}
    reference = None
    for i, build in enumerate(builders):
        engine = build(reference)
        if i == 0:
            reference = forced_reference_of(engine, workload, settings)
        for batch in settings.batch_sizes:
            prompts = cell_prompts(workload, settings, batch, forced=engine.mode == FORCED)
            log(f"batch {batch}: {engine.engine} {engine.mode}")
            cell = measure(engine, prompts, settings.max_tokens, settings.repeats, settings.warmup, workload.device,
                           concurrency=batch)
            cell.admission_batch_ratio, cell.mixed_prefill = scheduler_settings(engine)
            if cell.status == "ok":
                log(f"batch {batch}: {engine.engine} {engine.mode} -> ok {_fmt(cell.median('tokens_per_s'))} tok/s, "
                    f"{_fmt(cell.median('ms_per_step'))} ms/step")
            else:
                log(f"batch {batch}: {engine.engine} {engine.mode} -> {cell.status} ({cell.reason})")
            by_batch[batch][(cell.engine, cell.mode)] = cell
        del engine
        _release(workload.device)
        if on_engine is not None:
            on_engine(*_collect(by_batch, reference), skipped)
    return (*_collect(by_batch, reference), skipped)


def scheduler_settings(engine) -> tuple[float | None, bool | None]:
    """(admission_batch_ratio, mixed_prefill) that `engine`'s scheduler runs with: the effective
    values, after the per-engine defaults (a ratio of 0.25 with a drafter, 0 without, unless given),
    as load_profile records them; (None, None) for an engine without our scheduler (HF, z-lab)."""
    llm = getattr(engine, "llm", None)
    if llm is None:
        return None, None
    config = llm.engine.scheduler.config
    return config.admission_batch_ratio, config.mixed_prefill


def _collect(by_batch: dict, reference: list[int] | None) -> tuple[list[Cell], list[dict]]:
    cells = [c for row in by_batch.values() for c in row.values()]
    parity = [p for batch, row in by_batch.items() for p in _parity(batch, row, reference)]
    return cells, parity


def _release(device) -> None:
    """Free what a dropped engine held (its graphs, pools and cycles) before the next is built."""
    gc.collect()
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.empty_cache()


_PAIRS = ((("ours", DFLASH), ("ours", PLAIN)), (("hf", PLAIN), ("ours", PLAIN)),
          (("zlab", PLAIN), ("ours", PLAIN)), (("zlab", DFLASH), ("zlab", PLAIN)))


def _parity(batch: int, by_key: dict, forced_reference: list[int] | None) -> list[dict]:
    rows = []
    for cand, ref in _PAIRS:
        a, b = by_key.get(cand), by_key.get(ref)
        if a is None or b is None or a.token_ids is None or b.token_ids is None:
            continue
        rows.append({"batch_size": batch, "candidate": "/".join(cand), "reference": "/".join(ref),
                     **compare_outputs(a.token_ids, b.token_ids)})
    forced = by_key.get(("ours", FORCED))
    if forced is not None and forced.token_ids is not None and forced_reference is not None:
        rows.append({"batch_size": batch, "candidate": f"ours/{FORCED}", "reference": "ours/plain (batch 1)",
                     **compare_outputs(forced.token_ids, [forced_reference] * len(forced.token_ids))})
    return rows


def add_divergence_gaps(workload: Workload, settings: Settings, cells: list[Cell], parity: list[dict]) -> None:
    """Check whether our DFlash's mismatches with our plain decoding are near-ties (in place).

    Each "ours/dflash" vs "ours/plain" parity row with mismatches gets "divergences" (one dict
    per mismatched request, bench.near_ties.divergence_gaps) and "near_ties" (how many are near-ties);
    rows without mismatches get "divergences": [] and "near_ties": 0. One eager plain engine over
    the target is built for this only when some row has mismatches; when the target runs in a
    lower precision and was loaded from a folder (not random weights), a second one over its
    weights loaded again in float32 also judges each divergence ("near_ties_fp32",
    bench.near_ties: the gap without bf16 rounding; "fp32_picks_dflash": how many of them the
    float32 model resolves as our DFlash did).
    """
    from blockdraft.bench.engines.ours import OurEngine, PoolPlan
    from blockdraft.bench.near_ties import divergence_gaps
    from blockdraft.model_loader import load_target

    rows = [p for p in parity if (p["candidate"], p["reference"]) == (f"ours/{DFLASH}", f"ours/{PLAIN}")]
    for p in rows:
        p["divergences"], p["near_ties"] = [], 0
    todo = [p for p in rows if p["mismatched_requests"]]
    if not todo:
        return
    by_key = {(c.batch_size, c.engine, c.mode): c for c in cells}
    longest = max(len(pr) for pr in workload.prompts) + settings.max_tokens
    plan = PoolPlan(max(p["batch_size"] for p in todo), longest, 1)
    opts = {"enforce_eager": True} if workload.device.type == "cuda" else {}
    for name in ("enable_fp32_lm_head", "batch_invariant"):  # judge with the logits the runs decoded with
        if (settings.llm_options or {}).get(name):
            opts[name] = True
    engine = OurEngine(workload.target, str(workload.device), plan, options=opts)
    engine_fp32 = target_fp32 = None
    try:
        if workload.dtype != torch.float32 and os.path.isdir(workload.target.path):
            target_fp32 = load_target(workload.target.path, dtype="float32", device=str(workload.device))
            engine_fp32 = OurEngine(target_fp32, str(workload.device), plan, options=opts)
        for p in todo:
            batch = p["batch_size"]
            cand, ref = by_key[(batch, "ours", DFLASH)].token_ids, by_key[(batch, "ours", PLAIN)].token_ids
            prompts = cell_prompts(workload, settings, batch)
            p["divergences"] = divergence_gaps(engine.llm, prompts, cand, ref, p["first_mismatch"],
                                               None if engine_fp32 is None else engine_fp32.llm)
            p["near_ties"] = sum(d["near_tie"] for d in p["divergences"])
            if engine_fp32 is not None:
                p["near_ties_fp32"] = sum(d["near_tie_fp32"] for d in p["divergences"])
                p["fp32_picks_dflash"] = sum(d["fp32_picks"] == "candidate" for d in p["divergences"])
    finally:
        del engine, engine_fp32, target_fp32  # the float32 weights too, before the cache is emptied
        _release(workload.device)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
