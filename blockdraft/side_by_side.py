"""Time several engines on the same prompts in one process, interleaved, and keep their outputs.

The engines usually share one loaded target (`LLM(target=...)`) and differ only in speculation
(plain decoding vs a DFlash drafter at some K), so the comparison measures speculation alone on
the same weights, machine and moment. Each prompt is run by every engine before the next prompt
starts, and the engine that goes first rotates over prompts and repeats, so slow drift in machine
load (other processes, thermal state) lands on every engine alike. Requests run one at a time (batch 1): the
time of a `generate` call is that prompt's end-to-end latency, prefill included.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from blockdraft.engine.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams


@dataclass
class TimedRun:
    """One engine on one prompt, over all repeats.

    output: the output of the first repeat. seconds: wall time of each repeat's `generate` call.
    cpu_seconds: CPU time of this process (all threads) during each call; on a machine shared with
        other jobs it tracks the work done far more steadily than the wall time does.
    deterministic: every repeat produced the same token ids as the first.
    """

    output: RequestOutput
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    deterministic: bool = True

    @property
    def median_seconds(self) -> float:
        """Median wall time over the repeats (s)."""
        return statistics.median(self.seconds)

    @property
    def median_cpu_seconds(self) -> float:
        """Median process CPU time over the repeats (s)."""
        return statistics.median(self.cpu_seconds)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second at the median wall time."""
        return self.output.num_output_tokens / self.median_seconds if self.median_seconds > 0 else float("inf")


def timed_generate(llm, prompt, params: SamplingParams) -> tuple[RequestOutput, float, float]:
    """Run one prompt alone through `llm.generate`; returns (output, wall seconds, CPU seconds)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return out, time.perf_counter() - t0, time.process_time() - c0


def compare_engines(
    engines: Mapping[str, object],
    prompts: Sequence,
    params: SamplingParams,
    repeats: int = 1,
    warmup_tokens: int = 8,
    on_run: Callable[[str, int, int, float], None] | None = None,
    on_prompt: Callable[[int, int, dict[str, TimedRun]], None] | None = None,
) -> dict[str, list[TimedRun]]:
    """Run every prompt on every engine `repeats` times, interleaved; returns runs per engine label.

    Args:
        engines: label -> LLM (anything with `generate(prompts, params)`); their order is the run
            order for the first prompt of the first repeat.
        prompts: prompts in any form `LLM.generate` takes for one request (a str, a token-id list,
            or a chat conversation).
        params: sampling parameters for every run (use greedy or a fixed seed so runs compare).
        repeats: runs per (engine, prompt); the reported time is the median.
        warmup_tokens: each engine first generates this many tokens of every prompt, untimed, so
            one-time costs (oneDNN creates a kernel per new row count, e.g. each prompt's prefill;
            allocator growth) land on no timed run; 0 skips the warm-up.
        on_run: called as on_run(label, prompt_index, repeat, seconds) after every timed run
            (progress reports).
        on_prompt: called as on_prompt(prompt_index, repeat, {label: TimedRun}) once every engine
            has run that prompt in that repeat; the runs hold the repeats so far (repeat 0: each
            engine's output is known, to show it early; repeat `repeats - 1`: its timings are final).
    Returns:
        {label: [TimedRun per prompt, in prompt order]}.
    Raises:
        ValueError: no engines, no prompts, or repeats < 1.
    """
    if not engines:
        raise ValueError("compare_engines needs at least one engine")
    if not prompts:
        raise ValueError("compare_engines needs at least one prompt")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    labels = list(engines)
    if warmup_tokens > 0:
        # the constraint too: its one-time compile (and the grammar tokenizer) lands on no timed run
        warm = SamplingParams(max_tokens=warmup_tokens, temperature=params.temperature, seed=params.seed,
                              structured_outputs=params.structured_outputs)
        for label in labels:
            for prompt in prompts:  # one at a time: the timed runs' prefill shapes
                engines[label].generate([prompt], warm)
    runs: dict[str, list[TimedRun | None]] = {label: [None] * len(prompts) for label in labels}
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            first = (r + i) % len(labels)  # who goes first rotates over prompts and repeats
            for label in labels[first:] + labels[:first]:
                out, seconds, cpu_seconds = timed_generate(engines[label], prompt, params)
                if on_run is not None:
                    on_run(label, i, r, seconds)
                run = runs[label][i]
                if run is None:
                    runs[label][i] = TimedRun(out, [seconds], [cpu_seconds])
                else:
                    run.seconds.append(seconds)
                    run.cpu_seconds.append(cpu_seconds)
                    run.deterministic &= out.token_ids == run.output.token_ids
            if on_prompt is not None:
                on_prompt(i, r, {label: runs[label][i] for label in labels})
    return runs  # type: ignore[return-value]
