"""`blockdraft serve --enable-prompt-tokens-details` (vLLM's flag): `usage.prompt_tokens_details =
{"cached_tokens": N}`, the prompt tokens served from the prefix cache (RequestOutput.num_cached_tokens),
counted as prompt_tokens is (once per prompt, summed over a request's prompts), in whole and streamed
answers (the usage chunk) of /v1/completions and /v1/chat/completions; without the flag, no such
field. In-process servers over the tiny model with prefix caching on, pages of 4 tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.tiny_model import word

BS = 4  # --kv-block-size
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _server(model, details: bool):
    from blockdraft.llm import LLM
    from blockdraft.server.api import build_app
    from blockdraft.server.config import ServerConfig
    from tests.server.server_process import free_port
    from tests.server.test_engine_failure import _serving

    llm = LLM(model=str(model), enable_prefix_caching=True, kv_block_size=BS, num_kv_blocks=256)
    port = free_port()
    config = ServerConfig(port=port, served_model_name="t", log_requests=False, enable_prompt_tokens_details=details)
    return _serving(build_app(llm, config), port)


@pytest.fixture(scope="module")
def servers(tiny_model_dirs):
    model, _ = tiny_model_dirs
    with _server(model, details=True) as on, _server(model, details=False) as off:
        yield {"on": on, "off": off}


def _prompt(first: int, n_words: int = 30) -> str:
    """A prompt no other test sends (its own words), so the cache holds none of it at first."""
    return " ".join(word(first + i) for i in range(n_words))


def _body(kind: str, prompt, **kw) -> dict:
    first = {"prompt": prompt} if kind == "completions" else {"messages": [{"role": "user", "content": prompt}]}
    return {"model": "t", **first, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **kw}


def _usage(url: str, kind: str, prompt, **kw) -> dict:
    r = httpx.post(url + PATHS[kind], json=_body(kind, prompt, **kw), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _chunks(url: str, kind: str, prompt, **kw) -> list[dict]:
    body = _body(kind, prompt, stream=True, **kw)
    with httpx.stream("POST", url + PATHS[kind], json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_same_prompt_again_reports_its_cached_pages(servers, kind):
    prompt = _prompt(3 if kind == "completions" else 40)
    first = _usage(servers["on"], kind, prompt)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _usage(servers["on"], kind, prompt)
    cached = (second["prompt_tokens"] - 1) // BS * BS  # every full page but the one with the last token
    assert cached > 0 and second["prompt_tokens_details"] == {"cached_tokens": cached}
    assert {k: second[k] for k in first if k != "prompt_tokens_details"} == \
        {k: first[k] for k in first if k != "prompt_tokens_details"}


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_streamed_usage_chunk_carries_it(servers, kind):
    prompt = _prompt(5 if kind == "completions" else 42)
    want = _usage(servers["on"], kind, prompt)  # fills the cache
    want = (want["prompt_tokens"] - 1) // BS * BS
    chunks = _chunks(servers["on"], kind, prompt,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
    # vLLM: only the final usage carries it, not the per-chunk usage so far
    assert all("prompt_tokens_details" not in c["usage"] for c in chunks[:-1])


def test_counted_once_per_prompt_as_prompt_tokens_is(servers):
    """Two prompts already cached: both counted (summed); n=3 choices of one prompt: counted once,
    as the prompt's tokens are (each choice is an engine request that hits)."""
    prompt = _prompt(10)
    one = _usage(servers["on"], "completions", prompt)["prompt_tokens"]
    cached = (one - 1) // BS * BS
    both = _usage(servers["on"], "completions", [prompt, prompt])
    assert both["prompt_tokens"] == 2 * one and both["prompt_tokens_details"] == {"cached_tokens": 2 * cached}
    three = _usage(servers["on"], "completions", prompt, n=3, temperature=0.8, seed=1)
    assert three["prompt_tokens"] == one and three["prompt_tokens_details"] == {"cached_tokens": cached}
    # a cached prompt and a new one, 2 choices each: each prompt's first choice counts (not prompt 0's two)
    fresh = _prompt(11)
    mixed = _usage(servers["on"], "completions", [prompt, fresh], n=2, temperature=0.8, seed=1)
    assert mixed["prompt_tokens_details"] == {"cached_tokens": cached}


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_without_the_flag_usage_has_no_details(servers, kind):
    prompt = _prompt(20)
    for _ in range(2):  # the second one hits the cache
        assert "prompt_tokens_details" not in _usage(servers["off"], kind, prompt)
    chunks = _chunks(servers["off"], kind, prompt, stream_options={"include_usage": True})
    assert chunks[-1]["usage"]["prompt_tokens"] > 0 and "prompt_tokens_details" not in chunks[-1]["usage"]


def test_the_flag_is_off_by_default():
    from blockdraft.cli import _parser
    from blockdraft.server.launch import config_from_args

    assert config_from_args(_parser().parse_args(["serve"])).enable_prompt_tokens_details is False
    on = _parser().parse_args(["serve", "--enable-prompt-tokens-details"])
    assert config_from_args(on).enable_prompt_tokens_details is True
