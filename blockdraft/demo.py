"""`blockdraft demo`: a few real prompts decoded plainly and with DFlash, side by side, in one run.

Both engines share one loaded target (`LLM(target=...)`): the only difference between them is the
drafter. For each prompt the demo shows the answer, whether it is identical to plain decoding token
for token (speculation must be lossless), the mean acceptance length (accepted drafts + 1 per
verify step, from the engine's SpecStats) and the speed of both, measured interleaved in the same
process (blockdraft.side_by_side). Each answer is printed as soon as both engines have produced
it once; with one timed run, its speed line follows once that prompt's run is done, with more, the
speed lines of all prompts follow once every timed run is done. A speedup above the acceptance
length cannot be real (the timing was disturbed by other load): a warning line follows it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from blockdraft.side_by_side import TimedRun, compare_engines
from blockdraft.engine.request import SpecStats
from blockdraft.sampling_params import SamplingParams

# Short prompts, code and chat, sent as user messages through the chat template.
DEMO_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences what a Python list comprehension is.",
    "Write a short, friendly message inviting a colleague to lunch on Friday.",
)
PLAIN, DFLASH = "plain", "dflash"


@dataclass
class PromptResult:
    """One prompt: the answer, losslessness, acceptance and the speed of both engines.

    Times are per repeat, of the end-to-end `generate` call (prefill included), s: wall time, and
    process CPU time (steadier on a shared machine); tokens/s and speedup use median wall times.
    acceptance_length: None when the drafter proposed nothing (answer of one token).
    text / token_ids: the plain answer; dflash_token_ids: the speculative one when it differs.
    """

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    identical_to_plain: bool
    dflash_token_ids: list[int] | None
    deterministic: bool
    num_output_tokens: int
    acceptance_length: float | None
    acceptance_per_position: list[float | None]  # SpecStats.acceptance_rate_per_position
    num_verify_steps: int
    num_drafted_tokens: int
    num_accepted_tokens: int
    plain_seconds: list[float]
    dflash_seconds: list[float]
    plain_cpu_seconds: list[float]
    dflash_cpu_seconds: list[float]
    plain_tokens_per_s: float
    dflash_tokens_per_s: float
    speedup: float


@dataclass
class DemoReport:
    """Everything `blockdraft demo` prints (and writes with --json)."""

    model: str
    draft: str
    dtype: str
    num_speculative_tokens: int
    max_tokens: int
    repeats: int
    temperature: float
    seed: int | None
    num_threads: int
    draft_vocab_size: int = 0  # 0: the drafter scores the full vocabulary
    prompts: list[PromptResult] = field(default_factory=list)

    @property
    def all_identical(self) -> bool:
        return all(p.identical_to_plain and p.deterministic for p in self.prompts)

    def summary(self) -> dict:
        """Pooled over prompts: acceptance length over all verify steps, tokens/s over all time."""
        stats = SpecStats()
        for p in self.prompts:
            stats.merge(SpecStats(p.num_verify_steps, p.num_drafted_tokens, p.num_accepted_tokens))
        tokens = sum(p.num_output_tokens for p in self.prompts)
        plain_s = sum(_median(p.plain_seconds) for p in self.prompts)
        dflash_s = sum(_median(p.dflash_seconds) for p in self.prompts)
        return {
            "num_prompts": len(self.prompts),
            "num_identical": sum(p.identical_to_plain for p in self.prompts),
            "all_identical": self.all_identical,
            "num_output_tokens": tokens,
            "acceptance_length": stats.acceptance_length,
            "plain_tokens_per_s": tokens / plain_s if plain_s > 0 else None,
            "dflash_tokens_per_s": tokens / dflash_s if dflash_s > 0 else None,
            "speedup": plain_s / dflash_s if dflash_s > 0 else None,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = self.summary()
        return d


def run_demo(
    target,
    draft: str,
    prompts,
    params: SamplingParams,
    repeats: int = 1,
    num_speculative_tokens: int | None = None,
    raw: bool = False,
    model_name: str | None = None,
    on_start: Callable[[DemoReport], None] | None = None,
    on_run: Callable[[str, int, int, float], None] | None = None,
    draft_vocab_size: int | None = None,
    on_answer: Callable[[int, PromptResult], None] | None = None,
    on_timed: Callable[[int, PromptResult], None] | None = None,
) -> DemoReport:
    """Decode every prompt plainly and with the drafter on the same loaded target; compare.

    Args:
        target: a LoadedTarget (blockdraft.model_loader.load_target), shared by both engines.
        draft: DFlash drafter checkpoint folder.
        prompts: prompt strings; sent as user chat messages unless `raw`.
        params: sampling parameters of every run (greedy, or sampled with a fixed seed).
        repeats: runs per (engine, prompt), interleaved; times are medians.
        num_speculative_tokens: K (None: the drafter folder's recommended K, else block_size - 1).
        draft_vocab_size: draft vocabulary size (0: full; None: the folder's recorded one, else 0).
        on_start: called with the (still prompt-less) report once both engines are built.
        on_run: called after every timed run (see `compare_engines`).
        on_answer: called as on_answer(prompt_index, result) once both engines have answered that
            prompt once (answer, identical_to_plain and acceptance are final; times and
            `deterministic` cover that first run only).
        on_timed: called as on_timed(prompt_index, result) once all repeats of that prompt ran
            (the result that goes into the report).
    Raises:
        ValueError: no prompts, an empty prompt, sampling without a seed (runs would not compare),
            or a bad drafter / K (from the loaders).
    """
    from blockdraft.llm import LLM

    check_demo_inputs(prompts, params)
    import torch

    plain = LLM(target=target)
    spec = LLM(target=target, draft=draft, num_speculative_tokens=num_speculative_tokens,
               draft_vocab_size=draft_vocab_size)
    report = DemoReport(
        model=model_name or target.path, draft=str(draft), dtype=str(target.dtype).replace("torch.", ""),
        num_speculative_tokens=spec.speculator.num_speculative_tokens, max_tokens=params.max_tokens,
        repeats=repeats, temperature=params.temperature, seed=params.seed, num_threads=torch.get_num_threads(),
        draft_vocab_size=head.size if (head := getattr(spec.speculator, "draft_head", None)) is not None else 0,
    )
    if on_start is not None:
        on_start(report)
    inputs = [p if raw else [{"role": "user", "content": p}] for p in prompts]

    def on_prompt(index: int, repeat: int, runs: dict[str, TimedRun]) -> None:
        callbacks = ([on_answer] if repeat == 0 else []) + ([on_timed] if repeat == repeats - 1 else [])
        for callback in filter(None, callbacks):
            callback(index, _prompt_result(prompts[index], runs[PLAIN], runs[DFLASH]))

    runs = compare_engines({PLAIN: plain, DFLASH: spec}, inputs, params, repeats, on_run=on_run,
                           on_prompt=on_prompt)
    for prompt, p_run, s_run in zip(prompts, runs[PLAIN], runs[DFLASH]):
        report.prompts.append(_prompt_result(prompt, p_run, s_run))
    return report


def check_demo_inputs(prompts, params: SamplingParams) -> None:
    """The demo's own input rules (run_demo; the CLI runs them before loading the model).

    Raises:
        ValueError: no prompts, an empty prompt, one that is not valid Unicode (check_unicode_text), or
            sampling without a seed.
    """
    if not prompts:
        raise ValueError("demo needs at least one prompt")
    if any(not p.strip() for p in prompts):
        raise ValueError("prompt is empty: give non-empty prompts")
    from blockdraft.errors import check_unicode_text

    for i, p in enumerate(prompts):
        check_unicode_text(p, f"prompt {i + 1}")
    if params.temperature > 0 and params.seed is None:
        raise ValueError("sampling (temperature > 0) needs a seed so plain and speculative runs can be compared")


def _prompt_result(prompt: str, plain: TimedRun, spec: TimedRun) -> PromptResult:
    out = spec.output
    identical = list(out.token_ids) == list(plain.output.token_ids)
    return PromptResult(
        prompt=prompt,
        text=plain.output.text,
        token_ids=list(plain.output.token_ids),
        finish_reason=plain.output.finish_reason,
        identical_to_plain=identical,
        dflash_token_ids=None if identical else list(out.token_ids),
        deterministic=plain.deterministic and spec.deterministic,
        num_output_tokens=plain.output.num_output_tokens,
        acceptance_length=out.spec.acceptance_length,
        acceptance_per_position=out.spec.acceptance_rate_per_position(),
        num_verify_steps=out.spec.num_steps,
        num_drafted_tokens=out.spec.num_drafted_tokens,
        num_accepted_tokens=out.spec.num_accepted_tokens,
        plain_seconds=list(plain.seconds),
        dflash_seconds=list(spec.seconds),
        plain_cpu_seconds=list(plain.cpu_seconds),
        dflash_cpu_seconds=list(spec.cpu_seconds),
        plain_tokens_per_s=plain.tokens_per_s,
        dflash_tokens_per_s=spec.tokens_per_s,
        speedup=plain.median_seconds / spec.median_seconds,
    )


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- text output --------------------------------------------------------------------------------


def format_header(r: DemoReport) -> str:
    """First lines: what runs against what."""
    return (
        f"blockdraft demo: {r.model} ({r.dtype}, CPU, {r.num_threads} thread{'s' * (r.num_threads != 1)}) "
        f"+ DFlash drafter "
        f"{r.draft} (K = {r.num_speculative_tokens} drafts per step"
        f"{f', draft vocabulary {r.draft_vocab_size} ids' if r.draft_vocab_size else ''})\n"
        f"each prompt: plain decoding and speculative decoding on the same loaded weights, "
        f"{_sampling_words(r.temperature, r.seed)}, at most {r.max_tokens} tokens, "
        f"{r.repeats} timed run{'s' * (r.repeats != 1)} each, interleaved"
    )


def format_answer(index: int, total: int, p: PromptResult) -> str:
    """One prompt's answer block (known after the first run): prompt, answer, losslessness line."""
    tau = "n/a (no drafts)" if p.acceptance_length is None else f"{p.acceptance_length:.2f}"
    return (
        f"[{index}/{total}] {p.prompt}\n{p.text.rstrip()}\n"
        f"  -> identical to plain: {_yes(p.identical_to_plain)} | {p.num_output_tokens} tokens | "
        f"acceptance length {tau}"
    )


def format_speed(index: int, total: int, p: PromptResult) -> str:
    """One prompt's speed line (after all its timed runs): tokens/s at the median time, speedup;
    followed by a warning line when the speedup exceeds the acceptance length (_disturbed_note)."""
    flaky = "" if p.deterministic else " | repeats gave the same tokens: NO"
    return (
        f"  -> [{index}/{total}] plain {p.plain_tokens_per_s:.1f} tok/s | DFlash {p.dflash_tokens_per_s:.1f} tok/s | "
        f"speedup {p.speedup:.2f}x{flaky}"
    ) + _disturbed_note(p.speedup, p.acceptance_length, "  ")


def _disturbed_note(speedup: float | None, acceptance_length: float | None, indent: str = "") -> str:
    """A warning line when `speedup` exceeds `acceptance_length`, else ''.

    Such a speedup is not real: a verify step commits at most acceptance-length tokens on average
    and costs about a plain step or more, so the plain runs must have been slowed (other jobs on
    the machine) and the timing is disturbed.
    """
    if speedup is None or acceptance_length is None or speedup <= acceptance_length:
        return ""
    return (
        f"\n{indent}warning: speedup {speedup:.2f}x exceeds the acceptance length {acceptance_length:.2f}, which is "
        f"impossible: the timing looks disturbed by other load on the machine; re-run with --repeats 3 "
        f"(or on a quiet machine)"
    )


def format_summary(report: DemoReport) -> str:
    """The last line: pooled over all prompts; then warning lines when the pooled speedup exceeds
    the pooled acceptance length (_disturbed_note), plain speed swung across runs (_busy_note) or
    some run got far less CPU time than the others (_starved_note)."""
    s = report.summary()
    tau = "n/a" if s["acceptance_length"] is None else f"{s['acceptance_length']:.2f}"
    return (
        f"summary: identical to plain on {s['num_identical']}/{s['num_prompts']} prompts | "
        f"{s['num_output_tokens']} tokens | acceptance length {tau} | "
        f"plain {s['plain_tokens_per_s']:.1f} tok/s | DFlash {s['dflash_tokens_per_s']:.1f} tok/s | "
        f"speedup {s['speedup']:.2f}x"
    ) + (_disturbed_note(s["speedup"], s["acceptance_length"]) + _busy_note(report) + _disturbed_prompts_note(report)
         + _starved_note(report))


def _disturbed_prompts_note(report: DemoReport) -> str:
    """A note line when some prompt's speedup exceeded its acceptance length (its speed line
    warned) while the pooled figures did not, so the summary's speedup includes those timings."""
    s = report.summary()
    if _disturbed_note(s["speedup"], s["acceptance_length"]):
        return ""  # the pooled warning already says it
    bad = [i + 1 for i, p in enumerate(report.prompts) if _disturbed_note(p.speedup, p.acceptance_length)]
    if not bad:
        return ""
    which = ", ".join(str(i) for i in bad)
    return (f"\nnote: the summary includes the disturbed timing of prompt{'s' * (len(bad) > 1)} {which} "
            f"(speedup above its acceptance length); rerun with --repeats 3 (or on a quiet machine)")


# Plain decoding speeds of one demo's runs further apart than this mean the machine was busy.
BUSY_SPREAD = 2.0


def _busy_note(report: DemoReport) -> str:
    """A warning line when plain decoding's speed swung more than BUSY_SPREAD x across the runs
    (other jobs took the cores: the timings, hence the speedup, are not to be trusted), else ''."""
    rates = [p.num_output_tokens / t for p in report.prompts for t in p.plain_seconds if t > 0 and p.num_output_tokens]
    if len(rates) < 2 or max(rates) <= BUSY_SPREAD * min(rates):
        return ""
    return (
        f"\nnote: plain decoding ran at {min(rates):.1f} to {max(rates):.1f} tok/s across runs "
        f"({max(rates) / min(rates):.1f}x apart): the machine was busy, so these timings are unreliable; "
        f"rerun when it is idle, with --repeats 3 (or --threads 1 on a shared machine)"
    )


# A run whose CPU time per wall second is below this share of the demo's best run's was starved:
# other processes took the cores. Undisturbed runs of one demo agree closely (on 2 cores, the 0.5B
# model: 1.98-1.99 CPU seconds per wall second, plain and DFlash alike). The share understates the
# slowdown (torch's threads spin while a sibling waits for a core: three busy processes made a run
# 10x slower at 40 % of the best share), hence a threshold close to 1.
STARVED_SHARE = 0.7


def _starved_note(report: DemoReport) -> str:
    """A note line naming the runs that got less than STARVED_SHARE of the CPU time per wall second
    of the demo's best run (plain or DFlash: a slowed DFlash run is what _busy_note, which looks at
    plain speed, misses), else ''. Their timings, and the speedups built on them, are unreliable."""
    runs = [(i + 1, label, cpu / wall) for i, p in enumerate(report.prompts)
            for label, walls, cpus in (("plain", p.plain_seconds, p.plain_cpu_seconds),
                                       ("DFlash", p.dflash_seconds, p.dflash_cpu_seconds))
            for wall, cpu in zip(walls, cpus) if wall > 0]
    best = max((share for *_, share in runs), default=0.0)
    starved = sorted({(i, label) for i, label, share in runs if share < STARVED_SHARE * best})
    if best <= 0 or not starved:
        return ""
    worst = min(share for *_, share in runs)
    which = ", ".join(f"prompt {i} {label}" for i, label in starved)
    return (f"\nnote: {which} got as little as {worst / best:.0%} of the CPU time per second of the best run: "
            f"other processes took the cores, so those timings and the speedup are unreliable; rerun on a quiet "
            f"machine, with --repeats 3 (or --threads 1 on a shared machine)")


def _sampling_words(temperature: float, seed: int | None) -> str:
    return "greedy" if temperature == 0 else f"sampled at T={temperature:g} with seed {seed}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


# ---- CLI ----------------------------------------------------------------------------------------


def add_parser(sub, default_model: str) -> None:
    """Register `blockdraft demo` on the CLI's subparsers."""
    from blockdraft.engine_args import add_draft_vocab_size_flag
    from blockdraft.weights.catalog import add_cache_dir_flag

    d = sub.add_parser(
        "demo",
        help="answer a few prompts plainly and with the DFlash drafter: answers, acceptance, speedup",
        description="Decode each prompt with plain decoding and with DFlash speculative decoding on the same "
        "loaded model, interleaved, and print the answer, whether it is identical to plain decoding, the "
        "acceptance length and the speedup measured in this run.",
    )
    d.add_argument("prompts", nargs="*", help="prompts (default: 3 built-in code and chat prompts)")
    d.add_argument("--model", default=default_model, help=f"catalog name, HF folder or .gguf (default {default_model})")
    d.add_argument("--draft", default="auto",
                   help="drafter folder, or 'auto' / 'shipped' for the one shipped for --model (default auto)")
    d.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step K (default: the drafter's measured K, else block_size - 1)")
    add_draft_vocab_size_flag(d)
    d.add_argument("--max-tokens", type=int, default=96, help="output tokens at most per prompt (default 96)")
    d.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and engine; medians (default 1)")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples with --seed")
    d.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0 (default 0)")
    d.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/KV dtype (default auto: the checkpoint's, bf16 for catalog models)")
    d.add_argument("--json", default=None, metavar="PATH", help="also write the full report as JSON to PATH")
    add_cache_dir_flag(d)
    d.set_defaults(func=main)


def main(args) -> int:
    """CLI body of `blockdraft demo`; exit code 1 when an answer differs from plain decoding.

    Raises:
        ValueError: bad flags (naming the value), no drafter for the model, bad prompts.
    """
    from blockdraft.drafters import SHIPPED
    from blockdraft.errors import check_writable_file
    from blockdraft.model_loader import load_target
    from blockdraft.preflight import preflight

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.json:  # fail before minutes of decoding, not after (missing folder, a folder, unwritable)
        check_writable_file(args.json, "--json")
    prompts = list(args.prompts) or list(DEMO_PROMPTS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    check_demo_inputs(prompts, params)
    # Drafter folder, its config against the target's, K, dtype: all before the weights load. The
    # demo compares against a drafter, so `auto` must find one: same error as `shipped`.
    pre = preflight(args.model, SHIPPED if args.draft == "auto" else args.draft, args.num_speculative_tokens,
                    args.dtype, cache_dir=args.cache_dir, draft_vocab_size=args.draft_vocab_size)
    draft = pre.draft
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    target = load_target(str(pre.target_path), args.dtype, cache_dir=args.cache_dir)

    def on_start(report: DemoReport) -> None:
        print(format_header(report) + "\n", flush=True)
        # the untimed warm-up (both engines, every prompt) comes before the first progress line
        which = "the prompt" if len(prompts) == 1 else f"each of the {len(prompts)} prompts"
        print(f"  (warming up: both engines on {which}, a few tokens, untimed)", file=sys.stderr, flush=True)

    def on_run(label: str, index: int, repeat: int, seconds: float) -> None:
        print(f"  (prompt {index + 1}/{len(prompts)}, run {repeat + 1}/{args.repeats}: {label} {seconds:.1f} s)",
              file=sys.stderr, flush=True)

    # One timed run: each speed line follows its answer. More: answers first, then the speed lines
    # together once every timed run is done, so no run's progress line (stderr) splits them.
    single = args.repeats == 1

    def on_answer(index: int, result: PromptResult) -> None:
        print(format_answer(index + 1, len(prompts), result) + ("" if single else "\n"), flush=True)

    def on_timed(index: int, result: PromptResult) -> None:
        if single:
            print(format_speed(index + 1, len(prompts), result) + "\n", flush=True)

    report = run_demo(target, draft, prompts, params, args.repeats, args.num_speculative_tokens, args.raw,
                      args.model, on_start, on_run, pre.draft_vocab_size, on_answer, on_timed)
    if not single:
        speed = [format_speed(i + 1, len(prompts), p) for i, p in enumerate(report.prompts)]
        print("\n".join([f"speed, median of {args.repeats} timed runs per engine:", *speed, ""]), flush=True)
    print(format_summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    if not report.all_identical:
        print("error: speculative decoding changed an answer; please report this as a bug", file=sys.stderr)
        return 1
    return 0
