"""Tool calling on the real Qwen2.5-Coder-0.5B-Instruct over HTTP (its template renders the tools
and asks for <tool_call> blocks): a named tool_choice and "required" give a valid get_weather call,
streamed as the whole answer; the shipped DFlash drafter gives plain decoding's calls; "auto" with
the hermes parser gives what vLLM's gives for this model.

This 0.5B model answers a tool question with the call's bare JSON (greedy, or a ```json block for
other wordings), never a <tool_call> block: that token is not among its likeliest first tokens,
and even a +8 logit bias on it leaves the bare JSON first. vLLM's hermes parser leaves such an
answer as content, and so does this server: the "auto" check pins that. (A regex constraint in
the hermes format is no way round: llguidance 1.9.1's mask allows only the added token
`<tool_call>` (id 151657) where the grammar forces that text, then its consume_token refuses that
token, and the request ends.)"""

import json

import httpx
import pytest

from blockdraft.llm import LLM, load_target

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-0.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def servers():
    from tests.server.test_tool_calls import _serve

    target = load_target(NAME, "bfloat16")
    flags = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")
    plain = LLM(target=target, dtype="bfloat16")
    spec = LLM(target=target, draft="auto", dtype="bfloat16")
    with _serve(plain, **flags) as plain_url, _serve(spec, **flags) as spec_url:
        yield {"plain": plain_url, "dflash": spec_url}


def _body(**kw) -> dict:
    return {"model": "t", "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 40, "temperature": 0.0, **kw}


def _ok(url: str, **kw) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=_body(**kw), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _city(call: dict) -> str:
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"}, arguments
    return arguments["city"]


def test_named_and_required_give_a_valid_get_weather_call_and_auto_reads_as_vllm(servers):
    named = _ok(servers["plain"], tool_choice=NAMED)["choices"][0]
    [call] = named["message"]["tool_calls"]
    assert "Paris" in _city(call) and named["finish_reason"] == "stop" and named["message"]["content"] == ""
    required = _ok(servers["plain"], tool_choice="required")["choices"][0]
    assert required["message"]["tool_calls"] and required["finish_reason"] == "tool_calls", required
    assert all("Paris" in _city(c) for c in required["message"]["tool_calls"])
    # streamed: the calls arrive as delta.tool_calls items, with no content
    for kw, want in ((dict(tool_choice=NAMED), named), (dict(tool_choice="required"), required)):
        with httpx.stream("POST", servers["plain"] + "/v1/chat/completions", json=_body(stream=True, **kw), timeout=600) as r:
            deltas = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
        arguments = {}
        for item in (t for d in deltas for t in d["delta"].get("tool_calls", [])):
            arguments[item["index"]] = arguments.get(item["index"], "") + item["function"]["arguments"]
        assert list(arguments.values()) == [c["function"]["arguments"] for c in want["message"]["tool_calls"]]
        assert deltas[-1]["finish_reason"] == want["finish_reason"]
    # "auto": this model writes the call as bare JSON, no <tool_call> block: content, as vLLM's hermes parser
    auto = _ok(servers["plain"], tool_choice="auto")["choices"][0]
    assert auto["message"]["tool_calls"] == [] and auto["finish_reason"] == "stop"
    assert json.loads(auto["message"]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    # DFlash: the same calls (ids aside)
    for kw in (dict(tool_choice=NAMED), dict(tool_choice="required")):
        ref, out = _ok(servers["plain"], **kw), _ok(servers["dflash"], **kw)
        assert [t["function"] for t in out["choices"][0]["message"]["tool_calls"]] == \
               [t["function"] for t in ref["choices"][0]["message"]["tool_calls"]]
        assert out["spec_decode_stats"]["num_accepted_tokens"] > 0
