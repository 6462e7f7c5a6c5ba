"""A server stopped (SIGTERM / Ctrl-C) with requests in flight (and one more refused with 429 meanwhile): they get SHUTDOWN_GRACE_S seconds to
finish, then those left are answered cleanly, a 503 OpenAI error (a stream: an error event, then
[DONE]), not the plain-text 500s and cut streams uvicorn's task cancellation gave (a server trial)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from blockdraft.server.launch import SHUTDOWN_GRACE_S
from tests.server.conftest import MODEL_NAME
from tests.server.server_process import start_server, stop_server, wait_ready

# enough queued work that some is left after the grace period: 64 choices of ~400 tokens each
# through a 2-sequence batch (the tiny model decodes a few hundred tokens per second here)
BODY = {"model": MODEL_NAME, "prompt": ["w05x w06x"] * 4, "n": 16, "max_tokens": 400, "ignore_eos": True,
        "temperature": 0}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_requests_left_after_the_grace_period_get_a_503_not_a_500(tiny_model_dirs, tmp_path, sig):
    server = start_server(tiny_model_dirs[0], tmp_path / "srv.log", "--no-draft", "--max-num-seqs", "2",
                          "--max-pending", "128", name=MODEL_NAME, log_level="info")
    results: dict[str, object] = {}
    try:
        wait_ready(server)

        def plain():
            r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=120)
            results["plain"] = (r.status_code, r.headers.get("content-type", ""), r.text)

        def stream():
            lines = []
            with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=120) as r:
                results["stream_status"] = r.status_code
                lines = [line for line in r.iter_lines() if line]
            results["stream"] = lines

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both requests' 128 choices admitted
            m = server.metrics()
            if m.get("blockdraft_num_requests_running", 0) + m.get("blockdraft_num_requests_waiting", 0) == 128:
                break
            time.sleep(0.2)
        # 128 choices in flight (--max-pending 128): one more is a 429 that says when to retry
        busy = httpx.post(server.url + "/v1/completions", json={**BODY, "n": 1, "prompt": "w05x"}, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
        assert "--max-pending" in busy.json()["error"]["message"]
        t0 = time.monotonic()
        server.process.send_signal(sig)
        for t in threads:
            t.join(timeout=60)
        waited = time.monotonic() - t0
        # Ctrl-C: exit 0; SIGTERM: uvicorn re-raises it once shut down, so the process ends by that signal
        assert server.process.wait(timeout=30) in (0, -sig), server.log_tail()
    finally:
        if server.process.poll() is None:
            stop_server(server)
    status, content_type, text = results["plain"]
    assert status == 503 and content_type.startswith("application/json"), (status, text[:300])
    assert json.loads(text)["error"]["message"] == "the server is shutting down"
    stream = results["stream"]
    assert results["stream_status"] == 200 and stream[-1] == "data: [DONE]", stream[-3:]
    assert json.loads(stream[-2][len("data: "):])["error"]["message"] == "the server is shutting down"
    assert all(json.loads(line[len('data: '):]) for line in stream[:-1])  # each chunk whole
    assert SHUTDOWN_GRACE_S - 1 <= waited < SHUTDOWN_GRACE_S + 10  # the grace period, then at once
    log = server.log.read_text()
    assert "Traceback" not in log and "client disconnected" not in log, log[-3000:]
    assert "answered with 503 / a stream error event" in log
