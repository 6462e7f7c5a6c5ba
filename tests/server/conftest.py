"""Real `blockdraft serve` processes on free loopback ports, serving a tiny random model.

Two servers start together once per session (startup is mostly importing torch):
    plain_server   no drafter, API key required (API_KEY), logs at info level
    dflash_server  DFlash drafter, no API key, a small KV pool (requests queue and get preempted)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.server_process import Server, start_server, stop_server, wait_ready
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

MODEL_NAME = "tiny"
API_KEY = "test-key-123"
# A small KV pool (96 pages of 4 tokens): under load, requests queue and get preempted.
DFLASH_ARGS = ("--kv-block-size", "4", "--num-kv-blocks", "96", "--draft")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny_serve")
    model = write_tiny_model(root / "model")
    return model, write_tiny_drafter(root / "drafter", model)


@pytest.fixture(scope="session")
def servers(tiny_model_dirs, tmp_path_factory):
    model, drafter = tiny_model_dirs
    logs = tmp_path_factory.mktemp("server_logs")
    plain = start_server(model, logs / "plain.log", api_key=API_KEY, name=MODEL_NAME, log_level="info")
    dflash = start_server(model, logs / "dflash.log", *DFLASH_ARGS, str(drafter), name=MODEL_NAME)
    try:
        wait_ready(plain)
        wait_ready(dflash)
        yield {"plain": plain, "dflash": dflash}
    finally:
        stop_server(plain)
        stop_server(dflash)


@pytest.fixture(scope="session")
def plain_server(servers) -> Server:
    return servers["plain"]


@pytest.fixture(scope="session")
def dflash_server(servers) -> Server:
    return servers["dflash"]


def openai_client(server: Server):
    """The official client, without retries (a retried 5xx would hide a failure)."""
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=server.api_key or "unused", max_retries=0, timeout=120)
