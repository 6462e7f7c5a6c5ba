"""A bounded load generator for a running server: N concurrent streaming clients for T seconds.

Each client loops over fixed cases (completions and chat, seeded sampling) whose correct text was
computed beforehand by one non-streamed request each; every `disconnect_every`-th request hangs up
after a couple of chunks. Used by tests/server/test_load.py (short) and scripts/load_server.py (60 s).
Only talks to the URL it is given (a loopback server started by the caller).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from tests.server.tiny_model import word


@dataclass
class Case:
    """One request body (stream is added when sent) and its correct text."""

    path: str
    body: dict
    expected: str = ""


@dataclass
class LoadReport:
    """What happened. Latencies in seconds; tokens = completion tokens of completed requests."""

    duration_s: float = 0.0
    completed: int = 0
    disconnected: int = 0
    status_4xx: int = 0
    status_5xx: int = 0
    transport_errors: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0

    def summary(self) -> str:
        def pct(xs, q):
            return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        return (
            f"{self.duration_s:.1f} s: {self.completed} completed, {self.disconnected} disconnected on purpose, "
            f"{self.status_4xx} 4xx, {self.status_5xx} 5xx, {len(self.transport_errors)} transport errors, "
            f"{len(self.wrong)} wrong | {self.tokens / self.duration_s:.1f} output tok/s, "
            f"{self.completed / self.duration_s:.2f} req/s | latency p50 {pct(self.latencies, 0.5):.3f} s "
            f"p99 {pct(self.latencies, 0.99):.3f} s | TTFT p50 {pct(self.ttfts, 0.5):.3f} s p99 {pct(self.ttfts, 0.99):.3f} s"
        )


def default_cases(model: str, n: int = 8, max_tokens: int = 24) -> list[Case]:
    """n cases, alternating completions and chat, seeded sampling at temperature 0.8."""
    cases = []
    for i in range(n):
        words = " ".join(word(1 + (7 * i + 3 * j) % 95) for j in range(4 + i % 5))
        common = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": 100 + i}
        if i % 2:
            cases.append(Case("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}))
        else:
            cases.append(Case("/v1/completions", {**common, "prompt": words}))
    return cases


def compute_expected(base_url: str, headers: dict, cases: list[Case]) -> None:
    """Fill each case's expected text with one non-streamed request, alone on the server."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        for case in cases:
            r = client.post(case.path, json=case.body)
            r.raise_for_status()
            c = r.json()["choices"][0]
            case.expected = c["text"] if "text" in c else c["message"]["content"]


async def run_load(base_url: str, headers: dict, cases: list[Case], clients: int = 64, duration_s: float = 20.0,
                   disconnect_every: int = 5) -> LoadReport:
    """Run `clients` streaming clients until `duration_s` has passed (each finishes its request)."""
    report = LoadReport()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    timeout = httpx.Timeout(300.0, connect=30.0)
    start = time.perf_counter()
    deadline = start + duration_s
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as http:

        async def client(i: int) -> None:
            k = i
            while time.perf_counter() < deadline:
                case = cases[k % len(cases)]
                hang_up = disconnect_every > 0 and k % disconnect_every == disconnect_every - 1
                await _one(http, case, hang_up, report)
                k += clients

        await asyncio.gather(*(client(i) for i in range(clients)))
    report.duration_s = time.perf_counter() - start
    return report


async def _one(http: httpx.AsyncClient, case: Case, hang_up: bool, report: LoadReport) -> None:
    body = {**case.body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, chunks, usage = None, "", 0, None
    try:
        async with http.stream("POST", case.path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                if r.status_code >= 500:
                    report.status_5xx += 1
                else:
                    report.status_4xx += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    report.wrong.append(f"error event: {chunk['error']}")
                    return
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
                chunks += 1
                if hang_up and chunks >= 3:
                    report.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        report.transport_errors.append(repr(e))
        return
    report.completed += 1
    report.latencies.append(time.perf_counter() - t0)
    if ttft is not None:
        report.ttfts.append(ttft)
    report.tokens += usage["completion_tokens"] if usage else 0
    if text != case.expected:
        report.wrong.append(f"{case.path} seed {case.body['seed']}: got {text!r}, expected {case.expected!r}")


def wait_idle(metrics, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll `metrics()` until no request runs or waits; returns the last sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics()
        idle = m["blockdraft_num_requests_running"] == 0 and m["blockdraft_num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
