"""What `blockdraft serve`'s start-up line says: the address it really listens on, and the context
length in effect (what /v1/models reports) with what set it."""

from __future__ import annotations

import re
import time

import httpx

from tests.server.server_process import STARTUP_TIMEOUT_S, start_server, stop_server

STARTUP_LINE = re.compile(r"serving 'tiny' \(.*\) on (http://127\.0\.0\.1:(\d+)), (context [^,]*), ")


def _start_up_line(server) -> re.Match:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while (found := STARTUP_LINE.search(server.log.read_text())) is None:
        assert server.process.poll() is None, server.log_tail()
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.3)
    return found


def test_port_0_prints_the_port_the_os_chose_and_the_line_the_context(tiny_model_dirs, tmp_path):
    """`--port 0` printed http://127.0.0.1:0; the line comes once the socket is bound, with its port.
    A context capped by the KV pool (20 pages x 16 tokens; the model's is 512) was not mentioned."""
    server = start_server(tiny_model_dirs[0], tmp_path / "serve.log", "--no-draft", "--port", "0",
                          "--num-kv-blocks", "20", log_level="info")
    try:
        url, port, context = _start_up_line(server).groups()
        assert int(port) > 0
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert context == ("context 320 tokens (capped by the KV pool of 20 pages x 16 tokens; the model's is 512: "
                           "raise --num-kv-blocks for more)")
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 320
    finally:
        stop_server(server)


def test_the_context_words_say_what_set_it():
    from types import SimpleNamespace

    from blockdraft.server.launch import _context_note

    kv = SimpleNamespace(num_blocks=1024, kv_block_size=16)
    assert _context_note(32768, 32768, kv, explicit=False) == "context 32768 tokens (the model's)"
    assert _context_note(4096, 32768, kv, explicit=True) == "context 4096 tokens (--max-model-len; the model's is 32768)"
    assert _context_note(16384, 32768, kv, explicit=False).startswith(
        "context 16384 tokens (capped by the KV pool of 1024 pages x 16 tokens; the model's is 32768")
