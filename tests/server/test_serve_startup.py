"""What `blockdraft serve`'s start-up line says: the address it really listens on."""

from __future__ import annotations

import re
import time

import httpx

from tests.server.server_process import STARTUP_TIMEOUT_S, start_server, stop_server

STARTUP_LINE = re.compile(r"serving 'tiny' \(.*\) on (http://127\.0\.0\.1:(\d+)), ")


def _start_up_line(server) -> re.Match:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while (found := STARTUP_LINE.search(server.log.read_text())) is None:
        assert server.process.poll() is None, server.log_tail()
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.3)
    return found


def test_port_0_prints_the_port_the_os_chose(tiny_model_dirs, tmp_path):
    """`--port 0` printed http://127.0.0.1:0; the line comes once the socket is bound, with its port."""
    server = start_server(tiny_model_dirs[0], tmp_path / "serve.log", "--no-draft", "--port", "0", log_level="info")
    try:
        url, port = _start_up_line(server).groups()
        assert int(port) > 0
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        stop_server(server)
