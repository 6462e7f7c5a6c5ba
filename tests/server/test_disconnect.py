"""A client that leaves (streaming or not) aborts its request and frees its KV pages at once;
request logs never contain prompt text."""

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.load import wait_idle

ABORTS = 'blockdraft_requests_total{finish_reason="abort"}'
LONG = {"model": MODEL_NAME, "prompt": "w05x w06x", "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}


def _wait_running(server, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while server.metrics()["blockdraft_num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def _assert_aborted_and_freed(server, aborts_before, n=1):
    after = wait_idle(server.metrics)
    assert after.get(ABORTS, 0) == aborts_before + n
    assert after["blockdraft_kv_cache_free_blocks"] == after["blockdraft_kv_cache_total_blocks"]


def test_non_streaming_client_that_leaves_aborts_its_request(plain_server):
    before = plain_server.metrics().get(ABORTS, 0)
    with pytest.raises(httpx.ReadTimeout):  # 8 x 480 tokens take far longer than 0.5 s
        httpx.post(
            plain_server.v1 + "/completions", json={**LONG, "n": 8}, headers=plain_server.headers(),
            timeout=httpx.Timeout(60, read=0.5),
        )
    _assert_aborted_and_freed(plain_server, before, n=8)


def test_streaming_client_that_leaves_aborts_its_request(plain_server):
    before = plain_server.metrics().get(ABORTS, 0)
    with httpx.Client(headers=plain_server.headers(), timeout=60) as client:
        with client.stream("POST", plain_server.v1 + "/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    _wait_running(plain_server)
                    break
    _assert_aborted_and_freed(plain_server, before)


def test_client_that_leaves_while_sending_the_body_is_one_log_line_not_a_500(plain_server):
    """The fresh-user trial's repro: headers and half the body, then close. Was logged as `ERROR
    internal error: ClientDisconnect()` with a traceback and counted as http_errors_total{status="500"}."""
    def errors():
        return {k: v for k, v in plain_server.metrics().items() if k.startswith("blockdraft_http_errors_total")}

    before = errors()
    address = urlsplit(plain_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\": \"hi".encode())
    line = "POST /v1/completions: client disconnected while sending the request body (14 of 1000 bytes received)"
    deadline = time.monotonic() + 30
    while line not in plain_server.log.read_text():
        assert time.monotonic() < deadline, plain_server.log_tail()
        time.sleep(0.1)
    log = plain_server.log.read_text()
    assert "ClientDisconnect" not in log and "Traceback" not in log, plain_server.log_tail()
    assert errors() == before


def test_request_log_has_no_prompt_text(plain_server):
    secret = "SecretPromptWord"
    r = httpx.post(
        plain_server.v1 + "/completions",
        json={"model": MODEL_NAME, "prompt": f"w05x {secret} w06x", "max_tokens": 3},
        headers=plain_server.headers(),
        timeout=60,
    )
    assert r.status_code == 200
    rid = r.json()["id"]
    deadline = time.monotonic() + 10
    while rid not in plain_server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = plain_server.log.read_text()
    assert rid in log and "prompt tokens" in log
    assert secret not in log and "w05x" not in log


def test_start_up_log_names_how_steps_run(plain_server):
    """The start-up line says whether CUDA graphs, async scheduling and mixed prefill are on (CPU:
    eager steps, so prompts join the decode steps) and the limits in effect (the CPU's default
    step budget: 512 tokens; 8192 on CUDA)."""
    assert ("CUDA graphs off, async scheduling off, mixed prefill on (admissions join decode steps: no admission "
            "batching), step budget 512 tokens, up to 64 requests" in plain_server.log.read_text())


def test_the_admission_note_says_what_applies():
    from blockdraft.config import SchedulerConfig
    from blockdraft.server.launch import _admission_note

    assert "off" in _admission_note(SchedulerConfig(mixed_prefill=False))
    assert _admission_note(SchedulerConfig(mixed_prefill=False, admission_batch_ratio=0.25)) == (
        ", admission batching ratio 0.25 (wait at most 8 steps)")
    assert "no admission batching" in _admission_note(SchedulerConfig(admission_batch_ratio=0.25))
