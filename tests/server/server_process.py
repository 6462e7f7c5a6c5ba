"""Start and stop real `blockdraft serve` processes on free loopback ports (tests and scripts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180  # a busy 2-core machine can take long to import torch twice at once


@dataclass
class Server:
    """A running server: its base URL (…/v1 for the openai client), API key and log file."""

    url: str
    api_key: str | None
    log: Path
    process: subprocess.Popen

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.url)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def read_metrics(url: str) -> dict[str, float]:
    """Parsed /metrics samples of the server at `url`: 'name{labels}' -> value."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log: Path, *extra: str, api_key: str | None = None, name: str = "tiny",
                 log_level: str = "warning") -> Server:
    """Start `blockdraft serve` in a subprocess serving `model_dir` as `name` (does not wait for it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "blockdraft.cli", "serve", "--model", str(model_dir), "--served-model-name", name,
           "--port", str(port), "--log-level", log_level, *extra]
    env = dict(os.environ)
    if api_key:
        env["BLOCKDRAFT_API_KEY"] = api_key  # not on the command line, like a real deployment
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=root)
    return Server(f"http://127.0.0.1:{port}", api_key, log, proc)


def wait_ready(server: Server, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not ready after {timeout_s} s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
