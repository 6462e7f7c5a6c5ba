"""If an engine step fails, waiting clients get a 503 error (JSON, or an SSE error event) instead of
hanging, /health turns 503, and new requests are refused. In-process server on a free port."""

import contextlib
import json
import threading
import time

import httpx

from blockdraft.server.api import build_app
from blockdraft.server.config import ServerConfig
from tests.conftest import make_llm
from tests.server.server_process import free_port


@contextlib.contextmanager
def _serving(app, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_failed_step_fails_waiting_requests_and_health(llama_target):
    llm = make_llm(llama_target)
    real_step, calls = llm.engine.step, []

    def step_that_breaks():
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    llm.engine.step = step_that_breaks
    port = free_port()
    app = build_app(llm, ServerConfig(port=port, served_model_name="t", log_requests=False))
    body = {"model": "t", "prompt": [5, 6, 7], "max_tokens": 50, "temperature": 0.0, "ignore_eos": True}
    with _serving(app, port) as url:
        assert httpx.get(url + "/health").status_code == 200
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine failed" in error["message"] and "simulated kernel failure" in error["message"]
        assert any("text" in json.loads(e).get("choices", [{}])[0] for e in events[:-2])  # tokens came first

        health = httpx.get(url + "/health")
        assert health.status_code == 503
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_after_fail_open_new_requests_get_the_shutdown_503(llama_target):
    """What a shutdown's grace period ends with (AsyncEngine.fail_open): the requests running get a
    503 naming the reason, and so does one submitted afterwards (its body or tokenization was still
    under way), instead of starting and being cut off by uvicorn later."""
    llm = make_llm(llama_target)
    port = free_port()
    app = build_app(llm, ServerConfig(port=port, served_model_name="t", log_requests=False))
    body = {"model": "t", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    with _serving(app, port) as url:
        out = {}
        running = threading.Thread(target=lambda: out.update(r=httpx.post(url + "/v1/completions", json=body, timeout=60)))
        running.start()
        engine = app.state.ctx.engine
        deadline = time.monotonic() + 30
        while engine.num_pending == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.state.ctx.engine.fail_open("the server is shutting down") == 1
        running.join(timeout=30)
        assert out["r"].status_code == 503 and out["r"].json()["error"]["message"] == "the server is shutting down"
        late = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["message"] == "the server is shutting down"
        assert engine.num_pending == 0
