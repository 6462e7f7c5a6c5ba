"""Load: 64 concurrent streaming clients (a fifth hang up mid-stream) against the DFlash server,
whose small KV pool makes requests queue and get preempted. No 5xx, every completed stream equals
the request's text alone, and afterwards every KV page is free. scripts/load_server.py runs the
same load for 60 s and reports throughput and latency percentiles."""

import asyncio
import threading

from tests.server.conftest import MODEL_NAME, openai_client
from tests.server.load import compute_expected, default_cases, run_load, wait_idle

CLIENTS = 64
DURATION_S = 20.0


def test_64_streaming_clients_with_disconnects(dflash_server):
    cases = default_cases(MODEL_NAME)
    compute_expected(dflash_server.url, dflash_server.headers(), cases)
    before = dflash_server.metrics()
    peak_waiting, done = [0.0], threading.Event()

    def watch_queue():  # proves the KV pool really filled up and requests queued
        while not done.wait(0.5):
            peak_waiting[0] = max(peak_waiting[0], dflash_server.metrics()["blockdraft_num_requests_waiting"])

    watcher = threading.Thread(target=watch_queue, daemon=True)
    watcher.start()
    try:
        report = asyncio.run(run_load(dflash_server.url, dflash_server.headers(), cases, clients=CLIENTS, duration_s=DURATION_S))
    finally:
        done.set()
        watcher.join()
    print(report.summary(), f"| peak waiting {peak_waiting[0]:.0f}")

    assert report.status_5xx == 0 and report.status_4xx == 0, dflash_server.log_tail()
    assert not report.transport_errors, report.transport_errors[:3]
    assert not report.wrong, report.wrong[:3]
    assert report.completed >= CLIENTS and report.disconnected > 0
    assert peak_waiting[0] > 0

    after = wait_idle(dflash_server.metrics)
    assert after["blockdraft_kv_cache_free_blocks"] == after["blockdraft_kv_cache_total_blocks"], "KV pages leaked"
    assert after["blockdraft_kv_cache_usage_ratio"] == 0.0
    aborts = 'blockdraft_requests_total{finish_reason="abort"}'
    assert after.get(aborts, 0) > before.get(aborts, 0)  # hang-ups reached the engine as aborts
    assert after.get('blockdraft_http_errors_total{status="500"}', 0) == 0

    # still serving, and still right
    client = openai_client(dflash_server)
    case = cases[0]
    out = client.completions.create(**{k: v for k, v in case.body.items()})
    assert out.choices[0].text == case.expected
