"""vLLM's `prompt_logprobs` request field on /v1/completions (per choice) and /v1/chat/completions
(top level): None first, then per prompt token {id: {"logprob", "rank", "decoded_token"}}, the prompt
token first, then the N most likely; the engine's RequestOutput.prompt_logprobs values; refused with
a stream (as vLLM) or above the logprobs limit; echo keeps its own count of alternatives."""

from __future__ import annotations

import httpx
import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME
from tests.server.test_completion_echo import PROMPT, PROMPT_IDS, _check_prompt_part
from tests.server.tiny_model import word

N = 3


@pytest.fixture(scope="module")
def engine_entries(tiny_model_dirs) -> list:
    """RequestOutput.prompt_logprobs of PROMPT_IDS (N alternatives) from an in-process engine."""
    llm = LLM(model=str(tiny_model_dirs[0]), num_kv_blocks=64, kv_block_size=4)
    return llm.generate([PROMPT_IDS], SamplingParams(max_tokens=1, prompt_logprobs=N))[0].prompt_logprobs


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_NAME, "temperature": 0, **body},
                      headers=server.headers(), timeout=120)


def _check(answer: list, entries: list, num_top: int) -> None:
    assert len(answer) == len(entries) and answer[0] is None
    for got, e in zip(answer[1:], entries[1:]):
        keys = list(got)
        assert keys[0] == str(e["token_id"])  # the prompt token first
        assert got[keys[0]]["rank"] == e["rank"] >= 1
        assert got[keys[0]]["logprob"] == pytest.approx(e["logprob"], abs=1e-4)
        assert all(v["decoded_token"] == word(int(k)) for k, v in got.items())  # token i decodes to word(i)
        top = [(int(k), v) for k, v in got.items() if v["rank"] <= num_top]
        want = e["top"][:num_top]
        assert [t for t, _ in top] == [t for t, _ in want]
        assert [v["rank"] for _, v in top] == list(range(1, num_top + 1))
        assert [v["logprob"] for _, v in top] == pytest.approx([lp for _, lp in want], abs=1e-4)
        assert len(got) == num_top + (e["rank"] > num_top)


@pytest.mark.parametrize("num_top", [0, N])
def test_completions_choice_carries_prompt_logprobs(plain_server, engine_entries, num_top):
    r = _post(plain_server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": num_top, "n": 2})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        _check(choice["prompt_logprobs"], engine_entries, num_top)


def test_chat_response_carries_prompt_logprobs_at_the_top_level(plain_server, tiny_model_dirs):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "prompt_logprobs": 2}
    r = _post(plain_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "prompt_logprobs" not in answer["choices"][0]
    plp = answer["prompt_logprobs"]
    assert plp[0] is None and len(plp) == answer["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 3 and sorted(v["rank"] for v in e.values())[:2] == [1, 2] for e in plp[1:])


def test_dflash_server_gives_the_same_prompt_logprobs(plain_server, dflash_server):
    body = {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 2}
    a, b = (_post(s, "/v1/completions", body) for s in (plain_server, dflash_server))
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    pa, pb = a.json()["choices"][0]["prompt_logprobs"], b.json()["choices"][0]["prompt_logprobs"]
    assert [list(e) if e else e for e in pa] == [list(e) if e else e for e in pb]
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_echo_keeps_its_own_number_of_alternatives(plain_server, engine_entries):
    r = _post(plain_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True,
                                                "prompt_logprobs": N})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    _check_prompt_part(choice["logprobs"], engine_entries, len(PROMPT_IDS), num_top=1)
    _check(choice["prompt_logprobs"], engine_entries, N)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_refused_with_a_stream_and_above_the_limit(plain_server, path, body):
    r = _post(plain_server, path, {**body, "max_tokens": 2, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs is not available with stream" in r.text, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"
    r = _post(plain_server, path, {**body, "max_tokens": 2, "prompt_logprobs": 10**6})
    assert r.status_code == 400 and "prompt_logprobs must be <=" in r.text and "1000000" in r.text, r.text
    r = _post(plain_server, path, {**body, "max_tokens": 2, "prompt_logprobs": -1})
    assert r.status_code == 400, r.text
    r = _post(plain_server, path, {**body, "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    assert r.status_code == 200 and "prompt_logprobs" not in r.text, r.text  # 0 with a stream asks for nothing
