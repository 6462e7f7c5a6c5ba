"""vLLM's `truncate_prompt_tokens` on /v1/completions and /v1/chat/completions: the prompt's last k
tokens run (-1: the last max_model_len), cut before the context check, so an overlong prompt is
answered; usage.prompt_tokens counts the kept tokens (vLLM counts the prompt the engine ran); the
answer equals that of the kept tokens sent as the prompt, with and without a DFlash drafter; a value
above max_model_len, 0 or below -1 is a 400 naming the field. In-process servers over the tiny model
(word-level tokenizer: word(i) is token i) with a 64-token context."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.tiny_model import word

CONTEXT = 64  # --max-model-len of both servers
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
LONG_IDS = [(7 * i) % 90 + 3 for i in range(100)]  # 100 tokens: more than the context
LONG_TEXT = " ".join(word(i) for i in LONG_IDS)


def _serve(llm):
    from blockdraft.server.api import build_app
    from blockdraft.server.config import ServerConfig
    from tests.server.server_process import free_port
    from tests.server.test_engine_failure import _serving

    port = free_port()
    return _serving(build_app(llm, ServerConfig(port=port, served_model_name="t", log_requests=False)), port)


@pytest.fixture(scope="module")
def servers(tiny_model_dirs):
    """{"plain": url, "dflash": url}: the same model and context, without and with the drafter."""
    from blockdraft.llm import LLM

    model, drafter = tiny_model_dirs
    plain = LLM(model=str(model), kv_block_size=4, num_kv_blocks=64, max_model_len=CONTEXT)
    spec = LLM(model=str(model), draft=str(drafter), kv_block_size=4, num_kv_blocks=64, max_model_len=CONTEXT)
    with _serve(plain) as plain_url, _serve(spec) as spec_url:
        yield {"plain": plain_url, "dflash": spec_url}


def _body(kind: str, prompt, **kw) -> dict:
    first = {"prompt": prompt} if kind == "completions" else {"messages": [{"role": "user", "content": prompt}]}
    return {"model": "t", **first, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **kw}


def _post(url: str, kind: str, prompt, **kw) -> httpx.Response:
    return httpx.post(url + PATHS[kind], json=_body(kind, prompt, **kw), timeout=120)


def _ok(url: str, kind: str, prompt, **kw) -> dict:
    r = _post(url, kind, prompt, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _chat_ids(url: str, content: str) -> list[int]:
    """The server's own token ids of a one-message chat (/tokenize)."""
    messages = [{"role": "user", "content": content}]
    return httpx.post(url + "/tokenize", json={"model": "t", "messages": messages}, timeout=60).json()["tokens"]


@pytest.mark.parametrize("server", ["plain", "dflash"])
def test_completions_run_the_last_k_tokens_of_an_overlong_prompt(servers, server):
    url = servers[server]
    assert _error(_post(url, "completions", LONG_TEXT))["param"] == "prompt"  # 100 tokens: no room
    cut = _ok(url, "completions", LONG_TEXT, truncate_prompt_tokens=20)
    assert cut["usage"]["prompt_tokens"] == 20
    assert cut["usage"]["completion_tokens"] == 8
    tail = _ok(servers["plain"], "completions", LONG_IDS[-20:])  # plain decoding of the tail as token ids
    assert _text(cut) == _text(tail) and len(_text(tail).split()) == 8
    ids = _ok(url, "completions", LONG_IDS, truncate_prompt_tokens=20)  # a token-id prompt is cut alike
    assert _text(ids) == _text(tail) and ids["usage"]["prompt_tokens"] == 20


@pytest.mark.parametrize("server", ["plain", "dflash"])
def test_chat_runs_the_last_k_tokens_of_its_templated_prompt(servers, server):
    url = servers[server]
    content = " ".join(word(i) for i in LONG_IDS[:70])
    ids = _chat_ids(url, content)
    assert len(ids) > CONTEXT
    assert _error(_post(url, "chat", content))["param"] == "messages"
    cut = _ok(url, "chat", content, truncate_prompt_tokens=25)
    assert cut["usage"]["prompt_tokens"] == 25
    tail = _ok(servers["plain"], "completions", ids[-25:])  # the template's last 25 tokens, sent as ids
    assert cut["choices"][0]["message"]["content"] == _text(tail)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streamed_usage_counts_the_kept_tokens(servers, kind):
    body = _body(kind, LONG_TEXT, stream=True, truncate_prompt_tokens=12,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})
    with httpx.stream("POST", servers["plain"] + PATHS[kind], json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens"] == 12 and chunks[-1]["usage"]["completion_tokens"] == 8
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {12}


def test_usage_sums_the_kept_tokens_of_each_prompt(servers):
    prompts = [LONG_IDS[:5], LONG_IDS[:30]]  # 5 tokens: nothing cut; 30: cut to 10
    body = _ok(servers["plain"], "completions", prompts, truncate_prompt_tokens=10)
    assert body["usage"]["prompt_tokens"] == 5 + 10
    one = _ok(servers["plain"], "completions", LONG_IDS[20:30])
    assert body["choices"][1]["text"] == _text(one)


def test_echo_and_prompt_logprobs_follow_the_kept_tokens(servers):
    """echo returns the kept tokens' text (their logprobs and text_offset describe it), and
    prompt_logprobs has one entry per kept token, the first null."""
    k = 6
    body = _ok(servers["plain"], "completions", LONG_TEXT, truncate_prompt_tokens=k, echo=True, logprobs=1,
               prompt_logprobs=1, max_tokens=2)
    choice = body["choices"][0]
    kept = " ".join(word(i) for i in LONG_IDS[-k:])
    assert choice["text"].startswith(kept) and not choice["text"].startswith(LONG_TEXT[:20])
    lp = choice["logprobs"]
    assert lp["tokens"][:k] == [word(i) for i in LONG_IDS[-k:]] and len(lp["tokens"]) == k + 2
    # each prompt token's text_offset points at it in the echoed text (after the space before it)
    assert all(choice["text"][o:].lstrip().startswith(t) for o, t in zip(lp["text_offset"][:k], lp["tokens"][:k]))
    assert lp["text_offset"][k] >= len(kept)  # the completion's tokens follow the echoed prompt
    assert len(choice["prompt_logprobs"]) == k and choice["prompt_logprobs"][0] is None
    assert body["usage"]["prompt_tokens"] == k


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_value_above_max_model_len_is_a_400(servers, kind):
    error = _error(_post(servers["plain"], kind, LONG_TEXT, truncate_prompt_tokens=CONTEXT + 1))
    assert error["param"] == "truncate_prompt_tokens"
    assert error["message"] == (f"truncate_prompt_tokens must be -1 or at most {CONTEXT} (this model's "
                                f"max_model_len in /v1/models), got {CONTEXT + 1}")


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("bad", [0, -2, "5", 1.5, True])
def test_zero_values_below_minus_one_and_other_types_are_a_400(servers, kind, bad):
    error = _error(_post(servers["plain"], kind, "w05x w06x", truncate_prompt_tokens=bad))
    assert error["param"] == "truncate_prompt_tokens"
    assert ("truncate_prompt_tokens must be None (no truncation), -1 (keep the last max_model_len tokens) or an "
            "integer >= 1") in error["message"]
    assert error["message"].endswith(f"got {json.dumps(bad)}")


def test_minus_one_keeps_max_model_len_tokens_which_leave_no_room(servers):
    """vLLM's -1: the last max_model_len tokens, the whole context; the 400 says what fits."""
    error = _error(_post(servers["plain"], "completions", LONG_TEXT, truncate_prompt_tokens=-1, max_tokens=None))
    assert error["param"] == "prompt"
    assert error["message"].startswith(f"prompt 0 has {CONTEXT} tokens; this model's context is {CONTEXT} tokens")
    assert error["message"].endswith(f"(after truncate_prompt_tokens -1; {CONTEXT - 1} leaves room for 1 output token)")
    error = _error(_post(servers["plain"], "completions", LONG_TEXT, truncate_prompt_tokens=-1, max_tokens=5))
    assert error["message"].endswith(f"(after truncate_prompt_tokens -1; {CONTEXT - 5} leaves room for 5 output tokens)")
    short = _ok(servers["plain"], "completions", LONG_IDS[:10], truncate_prompt_tokens=-1)
    assert short["usage"]["prompt_tokens"] == 10  # a prompt that fits is unchanged
