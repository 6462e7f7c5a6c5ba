"""OpenAI tool calling on /v1/chat/completions, as vLLM's server does it: `tools` reach the chat
template; tool_choice naming a function or "required" constrains the answer to calls (structured
outputs); "auto" with --enable-auto-tool-choice --tool-call-parser hermes parses <tool_call>
blocks; streams carry OpenAI tool-call deltas that the client accumulates to the whole answer;
assistant tool_calls and tool results render in a conversation; DFlash gives plain decoding's calls.

In-process servers over the tiny model with the printable-ASCII tokenizer (tests/conftest.py
make_ascii_tokenizer: braces and quotes, so JSON can be generated; llguidance reads it) and a chat
template that renders tools, tool calls and tool results. The random model likes spaces, which
JSON's flexible whitespace allows without end: the requests bias the space token away
(NO_SPACE), so constrained answers end within max_tokens. "auto" answers are scripted: a
structured_outputs choice of one text makes the engine write it, and the hermes parser reads it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

PATH = "/v1/chat/completions"
# printable ASCII only (the tokenizer has no newline); a tool renders as name(its required
# parameters) to keep prompts within the tiny model's 512-token context
CHAT_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}"
    "({{ (t.function.parameters or {}).get('required', []) | join(',') }}){% endfor %} {% endif %}"
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %} RESULT OF {{ m.tool_call_id }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: {}
NO_SPACE = {"1": -100.0}  # token 1 is " "
# "required": the random model would add calls without end; "," (token 13) less likely ends arrays sooner
FEW_CALLS = {**NO_SPACE, "13": -5.0}
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]
SCRIPT = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call> '
          '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')


def _valid_arguments(name: str, arguments: str) -> bool:
    """Whether `arguments` (JSON text) is valid for tool `name` (the schemas above: enums, bounds)."""
    value = json.loads(arguments)
    if name == "get_weather":
        return set(value) == {"city", "days"} and value["city"] in ("Oslo", "Paris", "Lima") and 1 <= value["days"] <= 7
    if name == "get_time":
        return value in ({"zone": "UTC"}, {"zone": "CET"})
    return name == "ping" and isinstance(value, dict)


def _write_model(root) -> tuple:
    from tests.conftest import make_ascii_tokenizer

    model = write_tiny_model(root / "model")
    tok = make_ascii_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(model))
    return model, write_tiny_drafter(root / "drafter", model)


def _serve(llm, **config):
    from blockdraft.server.api import build_app
    from blockdraft.server.config import ServerConfig
    from tests.server.server_process import free_port
    from tests.server.test_engine_failure import _serving

    port = free_port()
    return _serving(build_app(llm, ServerConfig(port=port, served_model_name="t", log_requests=False, **config)), port)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"plain": url, "dflash": url}: the same model without and with the DFlash drafter, both
    with --enable-auto-tool-choice --tool-call-parser hermes."""
    from blockdraft.llm import LLM

    model, drafter = _write_model(tmp_path_factory.mktemp("tools"))
    plain = LLM(model=str(model), kv_block_size=4, num_kv_blocks=128)
    spec = LLM(model=str(model), draft=str(drafter), kv_block_size=4, num_kv_blocks=128)
    flags = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with _serve(plain, **flags) as plain_url, _serve(spec, **flags) as spec_url:
        yield {"plain": plain_url, "dflash": spec_url}


@pytest.fixture(scope="module")
def url(servers) -> str:
    return servers["plain"]


def _body(**kw) -> dict:
    return {"model": "t", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "logit_bias": NO_SPACE, **kw}


def _post(url: str, **kw) -> httpx.Response:
    return httpx.post(url + PATH, json=_body(**kw), timeout=120)


def _ok(url: str, **kw) -> dict:
    r = _post(url, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(url: str, **kw) -> list[dict]:
    """Each choice of a streamed request as the OpenAI client accumulates it (its
    ChatCompletionStreamState over the raw chunks; the snapshot, which unlike the final completion
    also takes a choice cut by max_tokens): [{"content", "tool_calls", "finish_reason"}]."""
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    state = ChatCompletionStreamState()
    body = _body(**kw)
    extra = {k: body.pop(k) for k in ("structured_outputs",) if k in body}  # vLLM's fields: the client's extra_body
    for chunk in client.chat.completions.create(model="t", messages=body.pop("messages"), stream=True, extra_body=extra,
                                                **{k: v for k, v in body.items() if k != "model"}):
        state.handle_chunk(chunk)
    out = []
    for c in state.current_completion_snapshot.choices:
        calls = [{"id": t.id, "type": t.type, "function": {"name": t.function.name, "arguments": t.function.arguments}}
                 for t in c.message.tool_calls or []]
        out.append({"content": c.message.content or "", "tool_calls": calls, "finish_reason": c.finish_reason})
    return out


def _summary(body: dict) -> list[dict]:
    """Each choice of a whole answer in _streamed's form (content null as "")."""
    return [{"content": c["message"]["content"] or "", "tool_calls": c["message"]["tool_calls"],
             "finish_reason": c["finish_reason"]} for c in body["choices"]]


def _without_ids(choices: list[dict]) -> list[dict]:
    return [{**c, "tool_calls": [{**t, "id": None} for t in c["tool_calls"]]} for c in choices]


# ------------------------------------------------------------------------------- named / required


def test_named_tool_choice_gives_one_call_whose_arguments_follow_its_schema(url):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = _ok(url, tool_choice=choice, temperature=1.0, seed=3, n=3, logprobs=True, top_logprobs=2)
    assert len(body["choices"]) == 3
    for c in body["choices"]:
        message = c["message"]
        assert message["role"] == "assistant" and message["content"] == ""  # vLLM's "" for a named call
        [call] = message["tool_calls"]
        assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == len("chatcmpl-tool-") + 32
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert _valid_arguments("get_weather", call["function"]["arguments"]), call
        assert c["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a named call
        # logprobs are those of the answer's tokens: the arguments' text
        assert "".join(t["token"] for t in c["logprobs"]["content"]) == call["function"]["arguments"]
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in body["choices"])
    # a tool without parameters takes {}
    body = _ok(url, tool_choice={"type": "function", "function": {"name": "ping"}}, temperature=0.0)
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "ping" and json.loads(call["function"]["arguments"]) == {}


def test_required_gives_valid_calls_of_the_tools_and_finish_reason_tool_calls(url):
    body = _ok(url, tool_choice="required", temperature=1.0, seed=5, n=4, max_tokens=120, logit_bias=FEW_CALLS)
    assert max(len(c["message"]["tool_calls"]) for c in body["choices"]) > 1  # several calls in one answer
    for c in body["choices"]:
        assert c["message"]["content"] == "" and c["finish_reason"] == "tool_calls", c
        assert c["message"]["tool_calls"], c
        for call in c["message"]["tool_calls"]:
            assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
            assert _valid_arguments(call["function"]["name"], call["function"]["arguments"]), call
    ids = [t["id"] for c in body["choices"] for t in c["message"]["tool_calls"]]
    assert len(set(ids)) == len(ids)
    # parallel_tool_calls false: at most one call (maxItems 1)
    body = _ok(url, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5, n=4, max_tokens=120)
    assert all(len(c["message"]["tool_calls"]) == 1 and c["finish_reason"] == "tool_calls" for c in body["choices"])


def test_none_renders_the_tools_but_answers_text(url):
    """tool_choice "none" still gives the template the tools (vLLM's default); the answer is text."""
    with_tools = _ok(url, tool_choice="none", temperature=0.0, max_tokens=5)
    without = _ok(url, tools=None, temperature=0.0, max_tokens=5)
    # one token per character: the prompt grows by the template's tools line
    extra = with_tools["usage"]["prompt_tokens"] - without["usage"]["prompt_tokens"]
    assert extra == len("TOOLS: get_weather(city,days) get_time(zone) ping() ")
    message = with_tools["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message


# ------------------------------------------------------------------------------------------- auto


def test_auto_with_the_hermes_parser_reads_calls_and_content(url):
    body = _ok(url, tool_choice="auto", structured_outputs={"choice": [SCRIPT]}, temperature=0.0, max_tokens=200)
    [c] = body["choices"]
    message = c["message"]
    assert message["content"] == "Sure."  # the text outside the blocks, less the whitespace beside them
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert c["finish_reason"] == "tool_calls"
    # tools without tool_choice: "auto" (vLLM's default with tools); parallel_tool_calls false: the first call only
    body = _ok(url, structured_outputs={"choice": [SCRIPT]}, parallel_tool_calls=False, max_tokens=200)
    assert [t["function"]["name"] for t in body["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    # no calls: the text as it is, finish_reason the engine's
    body = _ok(url, tool_choice="auto", structured_outputs={"choice": ["no <tool_call>{bad}</tool_call>"]}, max_tokens=60)
    [c] = body["choices"]
    assert c["message"]["content"] == "no <tool_call>{bad}</tool_call>" and c["message"]["tool_calls"] == []
    assert c["finish_reason"] == "stop"


# -------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("kw", [
    dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=3, n=2),
    dict(tool_choice="required", temperature=1.0, seed=5, n=3, max_tokens=120, logit_bias=FEW_CALLS),
    dict(tool_choice="required", temperature=1.0, seed=5, max_tokens=45),  # cut: the calls completed before
    dict(tool_choice="auto", structured_outputs={"choice": [SCRIPT]}, max_tokens=200),
    dict(tool_choice="auto", structured_outputs={"choice": ["a <tool_call>{bad} <tool_call"]}, max_tokens=60),
], ids=["named", "required", "required-cut", "auto", "auto-malformed"])
def test_stream_deltas_accumulate_to_the_whole_answer(url, kw):
    whole = _summary(_ok(url, **kw))
    streamed = _streamed(url, **kw)
    assert _without_ids(streamed) == _without_ids(whole)
    assert all(t["id"].startswith("chatcmpl-tool-") for c in streamed for t in c["tool_calls"])


def test_stream_never_leaks_tags_and_sends_calls_as_deltas(url):
    """Raw chunks of an auto stream: content never holds a <tool_call> tag (nor a start of one),
    each call arrives in one delta with index, id, type, name and arguments."""
    lines = httpx.post(url + PATH, json=_body(tool_choice="auto", structured_outputs={"choice": [SCRIPT]}, max_tokens=200,
                                              stream=True), timeout=120).text.splitlines()
    deltas = [json.loads(line[6:])["choices"] for line in lines if line.startswith("data: {")]
    content = [c["delta"].get("content", "") for cs in deltas for c in cs]
    assert not any("<" in piece for piece in content) and "".join(content) == "Sure."
    calls = [t for cs in deltas for c in cs for t in c["delta"].get("tool_calls", [])]
    assert [(t["index"], t["type"], t["function"]["name"]) for t in calls] == [(0, "function", "get_weather"),
                                                                              (1, "function", "get_time")]
    assert deltas[-1][0]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------------------------- multi-turn


def test_a_conversation_with_a_tool_call_and_its_result(url):
    """An assistant turn with tool_calls (content null, arguments JSON text) and the tool's result:
    the template gets the arguments parsed (tojson writes the object, not a quoted string)."""
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    tokens = httpx.post(url + "/tokenize", json={"model": "t", "messages": messages, "tools": TOOLS[:1]}, timeout=60).json()
    text = "".join(chr(31 + t) for t in tokens["tokens"])
    assert text == (
        'TOOLS: get_weather(city,days) USER: weather in Oslo? ASSISTANT:  CALL call-1 get_weather {"city": "Oslo", "days": 2} TOOL: sunny RESULT OF '
        'call-1 ASSISTANT: ')
    body = _ok(url, messages=messages, tools=TOOLS[:1], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert body["usage"]["prompt_tokens"] == tokens["count"]
    assert _valid_arguments("get_weather", body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])


# ------------------------------------------------------------------------------------------ DFlash


def test_dflash_gives_the_tool_calls_of_plain_decoding(servers):
    requests = [dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=1, n=2),
                dict(tool_choice="required", temperature=0.8, seed=2, n=2, max_tokens=120, logit_bias=FEW_CALLS),
                dict(tool_choice="auto", structured_outputs={"choice": [SCRIPT]}, max_tokens=200)]
    drafted = 0
    for kw in requests:
        ref, out = _ok(servers["plain"], **kw), _ok(servers["dflash"], **kw)
        assert _without_ids(_summary(out)) == _without_ids(_summary(ref)), kw
        assert ref["spec_decode_stats"]["num_drafts"] == 0
        drafted += out["spec_decode_stats"]["num_draft_tokens"]
    assert drafted > 0
    assert _without_ids(_streamed(servers["dflash"], **requests[1])) == _without_ids(_summary(_ok(servers["plain"], **requests[1])))


# ------------------------------------------------------------------------------------ bad requests


@pytest.mark.parametrize("kw, param, words", [
    (dict(tool_choice="required", tools=None), "tool_choice", "tool_choice 'required' needs tools"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "names the function 'nope', which is not one of the tools (get_weather, get_time, ping)"),
    (dict(tool_choice="sometimes"), "tool_choice", "tool_choice must be one of 'none', 'auto', 'required'"),
    (dict(tool_choice={"type": "function", "name": "get_time"}), "tool_choice", "tool_choice must be one of"),
    (dict(tools=[*TOOLS, TOOLS[0]]), "tools", "tools[3].function.name 'get_weather' is also the name of tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "tools",
     "tools[0].function.parameters must be a JSON Schema of an object"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools",
     "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-', got 'a b'"),
    (dict(tools=[{"type": "retrieval"}]), "tools", "tools[0] must be"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "paramaters": {}}}]), "tools",
     "tools[0].function has unknown keys ['paramaters']"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     'tool_choice "required" constrains the answer to tool calls, so it cannot be combined with response_format'),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}], tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools[0].function.parameters", "tools[0].function.parameters"),
    (dict(messages=[{"role": "tool", "content": "sunny"}]), "messages[0]", "a tool message needs tool_call_id"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[0]", "tool_calls[0].function.arguments is not valid JSON"),
])
def test_bad_tool_requests_are_refused_naming_the_field(url, kw, param, words):
    r = _post(url, **kw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param, error


def test_auto_needs_the_parser_flags(tmp_path):
    """Without --enable-auto-tool-choice --tool-call-parser, "auto" (also the default with tools) is
    refused as vLLM refuses it; the other choices work."""
    from blockdraft.server.config import ModelInfo, ServerConfig
    from blockdraft.server.errors import APIError
    from blockdraft.server.params import build_plan
    from blockdraft.server.protocol import ChatCompletionRequest, parse_request

    model = ModelInfo("t", 96, 512, 512, 0, 0)
    for extra in ({"tool_choice": "auto"}, {}):
        req = parse_request(ChatCompletionRequest, {"messages": MESSAGES, "tools": TOOLS, **extra})
        with pytest.raises(APIError, match="needs the server started with --enable-auto-tool-choice and "
                                           "--tool-call-parser") as e:
            build_plan(req, [[1, 2]], ServerConfig(), model)
        assert e.value.param == "tool_choice"
    req = parse_request(ChatCompletionRequest, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})
    plan = build_plan(req, [[1, 2]], ServerConfig(), model)
    assert plan.tool_calls.mode == "required" and plan.params[0].structured_outputs.json["minItems"] == 1
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, got 'mistral'"):
        ServerConfig(tool_call_parser="mistral")
