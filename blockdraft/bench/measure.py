"""Timing one engine on one batch: warm-up, repeated runs, medians, and output parity.

Each repeat times two calls with device-synchronised wall clocks: a prefill-only call
(max_tokens=1) and the full call (max_tokens=M). Their difference is pure decoding, so

    ms per step      = (t_full - t_prefill) / (steps_full - steps_prefill)   [target forwards]
    decode tokens/s  = (tokens_full - tokens_prefill) / (t_full - t_prefill)
    tokens/s         = tokens_full / t_full                                 [end to end]

and every figure is the median over repeats. For DFlash a "step" is one verify forward plus the
drafting and bookkeeping around it, exactly what the engine does per step.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from blockdraft.bench.engines import BenchEngine, Generation
from blockdraft.errors import param_error


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(engine: BenchEngine, prompts: list[list[int]], max_tokens: int, device: torch.device,
                   concurrency: int | None = None):
    """(Generation, seconds) of one call, the clock started and stopped on an idle device."""
    synchronize(device)
    t0 = time.perf_counter()
    gen = engine.generate(prompts, max_tokens, concurrency)
    synchronize(device)
    return gen, time.perf_counter() - t0


@dataclass
class Run:
    """One repeat: the full call and the prefill-only call (seconds, target forwards, tokens)."""

    seconds: float
    num_steps: int
    num_tokens: int
    prefill_seconds: float
    prefill_steps: int
    prefill_tokens: int

    @property
    def decode_seconds(self) -> float:
        """Seconds of the full run minus the prefill-only run (s)."""
        return self.seconds - self.prefill_seconds

    @property
    def ttft_ms(self) -> float:
        """Wall milliseconds of the prefill-only call: time to the first token of every request."""
        return self.prefill_seconds * 1e3

    @property
    def ms_per_step(self) -> float | None:
        """Decode milliseconds per engine step (target forward, or verify + draft); None if no decode step."""
        steps = self.num_steps - self.prefill_steps
        return self.decode_seconds / steps * 1e3 if steps > 0 and self.decode_seconds > 0 else None

    @property
    def tokens_per_s(self) -> float:
        """Output tokens / wall seconds of the full run, prefill included (tokens/s)."""
        return self.num_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first / decode seconds (tokens/s); None when decode took no time."""
        if self.decode_seconds <= 0:
            return None
        return (self.num_tokens - self.prefill_tokens) / self.decode_seconds

    def to_dict(self) -> dict:
        """The raw fields (seconds, steps, tokens) as a JSON-ready dict."""
        return dict(self.__dict__)


@dataclass
class Cell:
    """One (engine, mode, batch size) measurement.

    batch_size: concurrent requests; num_requests: requests per run (>= batch_size: with more, a
    client keeps batch_size in flight and sends the next when one finishes).
    status: "ok", "n/a" (the engine cannot run this batch size; `reason` says why) or "error"
    (it raised; `reason` holds the message). token_ids: outputs of the last full run (for parity;
    not written to JSON). deterministic: every full run gave the same tokens.
    admission_batch_ratio / mixed_prefill: the scheduler settings our engine ran with (after its
    per-engine defaults: blockdraft.config.default_admission_batch_ratio; the ratio is ignored with
    mixed prefill); None for engines without our scheduler (HF, z-lab).
    """

    engine: str
    mode: str
    batch_size: int
    num_requests: int
    status: str = "ok"
    reason: str | None = None
    runs: list[Run] = field(default_factory=list)
    acceptance_length: float | None = None
    deterministic: bool | None = None
    token_ids: list[list[int]] | None = None
    admission_batch_ratio: float | None = None
    mixed_prefill: bool | None = None

    def median(self, metric: str) -> float | None:
        """Median over runs of a Run property (None if no run has it)."""
        values = [v for v in (getattr(r, metric) for r in self.runs) if v is not None]
        return statistics.median(values) if values else None

    def summary(self) -> dict:
        """The JSON row (without ratios; see report.add_speedups)."""
        return {
            "engine": self.engine,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "num_requests": self.num_requests,
            "status": self.status,
            "reason": self.reason,
            "tokens_per_s": self.median("tokens_per_s"),
            "decode_tokens_per_s": self.median("decode_tokens_per_s"),
            "ms_per_step": self.median("ms_per_step"),
            "ttft_ms": self.median("ttft_ms"),
            "seconds": self.median("seconds"),
            "acceptance_length": self.acceptance_length,
            "deterministic": self.deterministic,
            "admission_batch_ratio": self.admission_batch_ratio,
            "mixed_prefill": self.mixed_prefill,
            "runs": [r.to_dict() for r in self.runs],
        }


def measure(
    engine: BenchEngine, prompts: list[list[int]], max_tokens: int, repeats: int, warmup: int, device: torch.device,
    concurrency: int | None = None,
) -> Cell:
    """Warm up `warmup` full calls, then `repeats` x (prefill-only call, full call), each over all
    `prompts` with at most `concurrency` requests in flight (None: all at once).

    An engine that raises is recorded as status "error" (traceback on stderr) so one broken
    baseline does not lose the rest of a device run.
    Raises:
        ValueError: max_tokens < 2 (no decode step to time) or repeats < 1.
    """
    if max_tokens < 2:
        raise param_error("max_tokens", f"max_tokens must be >= 2 so that decode steps exist to time, got {max_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    concurrency = min(concurrency or len(prompts), len(prompts))
    cell = Cell(engine.engine, engine.mode, concurrency, len(prompts))
    reason = engine.unsupported(concurrency)
    if reason is not None:
        cell.status, cell.reason = "n/a", reason
        return cell
    try:
        outputs = []
        for _ in range(warmup):
            outputs.append(engine.generate(prompts, max_tokens, concurrency).token_ids)
        last: Generation | None = None
        for _ in range(repeats):
            first, t1 = timed_generate(engine, prompts, 1, device, concurrency)
            last, t = timed_generate(engine, prompts, max_tokens, device, concurrency)
            cell.runs.append(Run(t, last.num_steps, _count(last), t1, first.num_steps, _count(first)))
            outputs.append(last.token_ids)
        cell.token_ids = last.token_ids
        cell.acceptance_length = last.acceptance_length
        cell.deterministic = all(o == outputs[0] for o in outputs)
    except Exception as e:  # noqa: BLE001 - recorded in the report, the run goes on
        traceback.print_exc(file=sys.stderr)
        cell.status, cell.reason, cell.runs = "error", f"{type(e).__name__}: {e}"[:500], []
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cell


def _count(gen: Generation) -> int:
    return sum(len(t) for t in gen.token_ids)


def compare_outputs(candidate: list[list[int]], reference: list[list[int]]) -> dict:
    """Token-for-token comparison of two batches of outputs (same prompts, same order).

    Returns {"num_requests", "mismatched_requests", "first_mismatch": [index of the first
    differing token per request, or None when equal]}. Length differences count as a mismatch at
    the shorter length.
    Raises:
        ValueError: different numbers of requests.
    """
    if len(candidate) != len(reference):
        raise ValueError(f"cannot compare {len(candidate)} outputs with {len(reference)} reference outputs")
    first = []
    for a, b in zip(candidate, reference):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        first.append(diff)
    return {
        "num_requests": len(reference),
        "mismatched_requests": sum(d is not None for d in first),
        "first_mismatch": first,
    }
