"""Load a blockdraft server with concurrent streaming clients and report throughput and latency.

Not a test: by default it starts its own `blockdraft serve` on a free loopback port with the tiny
random test model (and a DFlash drafter, a small KV pool so requests queue), runs 64 streaming
clients for 60 s of which every fifth hangs up mid-stream, checks every completed text against the
same request run alone, and checks that the KV pool is fully free afterwards. Exit code 1 on any
5xx, transport error, wrong text or leaked KV page.

    python scripts/load_server.py                         # 64 clients, 60 s, tiny model + DFlash
    python scripts/load_server.py --no-draft --duration 30
    python scripts/load_server.py --url http://127.0.0.1:8000 --model-name NAME   # an already running server

Traffic goes only to the given URL (default: the loopback server it starts) and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.server helpers

from tests.server.load import compute_expected, default_cases, run_load, wait_idle  # noqa: E402
from tests.server.server_process import Server, read_metrics, start_server, stop_server, wait_ready  # noqa: E402
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model  # noqa: E402


def main() -> int:
    args = _args()
    with tempfile.TemporaryDirectory() as tmp:
        server = None if args.url else _start_own(Path(tmp), args)
        url = args.url or server.url
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            return _run(url, headers, server, args)
        finally:
            if server is not None:
                stop_server(server)


def _run(url: str, headers: dict, server: Server | None, args) -> int:
    if not url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise SystemExit("refusing a non-loopback URL: run this against a server on this machine")
    metrics = lambda: read_metrics(url)  # noqa: E731
    cases = default_cases(args.model_name, max_tokens=args.max_tokens)
    compute_expected(url, headers, cases)
    print(f"load: {args.clients} streaming clients for {args.duration:.0f} s against {url} ...", flush=True)
    report = asyncio.run(
        run_load(url, headers, cases, clients=args.clients, duration_s=args.duration, disconnect_every=args.disconnect_every)
    )
    print(report.summary())
    after = wait_idle(metrics)
    free, total = after["blockdraft_kv_cache_free_blocks"], after["blockdraft_kv_cache_total_blocks"]
    aborted = after.get('blockdraft_requests_total{finish_reason="abort"}', 0)
    print(f"after the load: KV pages free {free:.0f} / {total:.0f}; requests aborted by hang-ups so far: {aborted:.0f}")
    for line in report.wrong[:5] + report.transport_errors[:5]:
        print("  ", line)
    ok = report.status_5xx == 0 and not report.transport_errors and not report.wrong and free == total
    if server is not None:
        log = server.log.read_text(errors="replace")
        print(f"server log: {log.count('Traceback')} tracebacks, {log.count(' ERROR ')} error lines")
        ok = ok and "Traceback" not in log
        if not ok:
            print(server.log_tail())
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def _start_own(tmp: Path, args) -> Server:
    model = write_tiny_model(tmp / "model")
    extra = ["--kv-block-size", "4", "--num-kv-blocks", str(args.num_kv_blocks)]
    if not args.no_draft:
        extra += ["--draft", str(write_tiny_drafter(tmp / "drafter", model))]
    server = start_server(model, tmp / "server.log", *extra, name=args.model_name)
    wait_ready(server)
    return server


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--url", default=None, help="an already running server on this machine (default: start the tiny one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-name", default="tiny", help="model id to send (the served name)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--disconnect-every", type=int, default=5, help="every k-th request hangs up mid-stream (0: none)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--no-draft", action="store_true", help="own server: plain decoding")
    p.add_argument("--num-kv-blocks", type=int, default=96, help="own server: KV pages of 4 tokens")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
