"""`blockdraft serve --enable-prefix-caching` (DFlash drafter): the same texts as the plain server for
requests sharing a long prompt prefix, and /metrics counts the prefix-cache queries and hits (tokens)."""

import pytest

from tests.server.conftest import DFLASH_ARGS, MODEL_NAME, openai_client
from tests.server.server_process import start_server, stop_server, wait_ready
from tests.server.tiny_model import word

SYSTEM = " ".join(word(i) for i in range(3, 43))  # a 40-word shared prefix


@pytest.fixture(scope="module")
def cached_server(tiny_model_dirs, tmp_path_factory):
    model, drafter = tiny_model_dirs
    log = tmp_path_factory.mktemp("prefix_log") / "server.log"
    server = start_server(model, log, *DFLASH_ARGS, str(drafter), "--enable-prefix-caching", name=MODEL_NAME)
    try:
        wait_ready(server)
        yield server
    finally:
        stop_server(server)


def test_prefix_cached_server_equals_plain_and_counts_hits(plain_server, cached_server):
    plain, cached = openai_client(plain_server), openai_client(cached_server)
    before = cached_server.metrics()
    for tail in (word(50), word(51), word(52) + " " + word(53)):
        kw = dict(model=MODEL_NAME, prompt=f"{SYSTEM} {tail}", max_tokens=24, temperature=0.0,
                  extra_body={"ignore_eos": True})
        ref, out = plain.completions.create(**kw), cached.completions.create(**kw)
        assert [c.text for c in out.choices] == [c.text for c in ref.choices]
    after = cached_server.metrics()
    queries = after["blockdraft_prefix_cache_queries_total"] - before.get("blockdraft_prefix_cache_queries_total", 0)
    hits = after["blockdraft_prefix_cache_hits_total"] - before.get("blockdraft_prefix_cache_hits_total", 0)
    assert queries >= 3 * 40 and hits >= 2 * 36  # the 2nd and 3rd requests reuse the prefix's full pages
    # off by default: both series are still exported, at 0 (the README says so)
    plain = plain_server.metrics()
    assert plain["blockdraft_prefix_cache_hits_total"] == plain["blockdraft_prefix_cache_queries_total"] == 0
