"""Chat message fields vLLM accepts: `messages[i].name` (passed on to the chat template) and the
`developer` role (given to the template as `system`). No server process: parse + chat_prompt."""

from __future__ import annotations

import copy

import pytest

from blockdraft.server.errors import APIError
from blockdraft.server.params import chat_prompt
from blockdraft.server.protocol import MAX_NAME_CHARS, ChatCompletionRequest, parse_request
from blockdraft.weights.fetch import cache_root, is_complete
from tests.server.tiny_model import word, write_tiny_model

QWEN = "qwen2.5-coder-0.5b-instruct"


def _real(name: str):
    """Parametrize entry for a catalog model's tokenizer: slow (fetched first) unless cached."""
    cached = is_complete(cache_root() / "models" / name)
    return pytest.param(name, marks=[] if cached else [pytest.mark.slow])


@pytest.fixture(scope="module", params=["tiny", _real(QWEN)])
def tokenizer(request, tmp_path_factory):
    from blockdraft.weights.fetch import resolve_model_path
    from blockdraft.weights.loader import load_tokenizer

    if request.param == "tiny":  # its template renders system as w01x, user w02x, anything else w03x
        return load_tokenizer(write_tiny_model(tmp_path_factory.mktemp("chat_fields") / "model"))
    return load_tokenizer(resolve_model_path(request.param))


def _prompt(tokenizer, messages, **fields) -> list[int]:
    return chat_prompt(parse_request(ChatCompletionRequest, {"messages": messages, **fields}), tokenizer)


def _conv(first_role: str, **first_fields):
    return [{"role": first_role, "content": f"{word(9)} {word(10)}", **first_fields},
            {"role": "user", "content": f"{word(12)} {word(40)}"}]


def test_developer_message_renders_exactly_as_a_system_message(tokenizer):
    dev = _prompt(tokenizer, _conv("developer"))
    assert dev == _prompt(tokenizer, _conv("system"))
    text = tokenizer.decode(dev)
    assert "developer" not in text
    if tokenizer.chat_template.startswith("{% for m in messages %}"):  # the tiny template
        assert text.split()[0] == word(1)
    else:  # Qwen: the message is the system turn (not Qwen's default system prompt plus another turn)
        assert text.startswith(f"<|im_start|>system\n{word(9)} {word(10)}<|im_end|>")


def test_name_leaves_the_prompt_unchanged_for_templates_that_ignore_it(tokenizer):
    plain = _prompt(tokenizer, _conv("user"))
    assert _prompt(tokenizer, _conv("user", name="alice_agent-2")) == plain
    assert _prompt(tokenizer, _conv("user", name=None)) == plain
    assert _prompt(tokenizer, _conv("developer", name="planner")) == _prompt(tokenizer, _conv("system"))


def test_name_is_passed_on_to_the_chat_template(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['name'] | default('" + word(4) + "') }} {{ m['content'] }} {% endfor %}"
    req = parse_request(ChatCompletionRequest, {"messages": _conv("developer", name=word(7))})
    assert req.messages[0].template_message() == {"role": "system", "content": f"{word(9)} {word(10)}", "name": word(7)}
    assert "name" not in req.messages[1].template_message()
    text = tok.decode(chat_prompt(req, tok))
    assert text.split()[:4] == [word(7), word(9), word(10), word(4)]


@pytest.mark.parametrize(
    "name, match",
    [
        (5, "Input should be a valid string"),
        (True, "Input should be a valid string"),
        (["bob"], "Input should be a valid string"),
        ("x" * (MAX_NAME_CHARS + 1), f"String should have at most {MAX_NAME_CHARS} characters"),
    ],
    ids=["int", "bool", "list", "too-long"],
)
def test_bad_name_is_refused_naming_the_field(name, match):
    with pytest.raises(APIError, match=rf"invalid 'messages\[1\]\.name': {match}") as e:
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "w05x"},
                                                            {"role": "user", "content": "w05x", "name": name}]})
    assert e.value.status == 400 and e.value.param == "messages[1].name"
    parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "w05x", "name": "x" * MAX_NAME_CHARS}]})


def test_unknown_roles_are_still_refused_and_the_allowed_ones_listed():
    with pytest.raises(APIError, match="role 'robot' is not supported; allowed roles: 'system', 'user', 'assistant', "
                                       "'developer', 'tool'"):
        parse_request(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "w05x"}]})


# The Python API (LLM.encode_chat, which LLM.chat and LLM.generate use) renders what the server
# renders: one normalisation (blockdraft.chat_messages.template_messages / template_message).
PARITY = {
    "developer": [{"role": "developer", "content": f"{word(9)} {word(10)}"}, {"role": "user", "content": word(12)}],
    "text-parts": [{"role": "system", "content": [{"type": "text", "text": word(9)}, {"type": "text", "text": word(10)}]},
                   {"role": "user", "content": [{"type": "text", "text": f"{word(12)} {word(40)}"}]}],
    "name": [{"role": "user", "content": word(12), "name": word(7)}, {"role": "assistant", "content": word(13)},
             {"role": "user", "content": word(14)}],
    "tool-call": [{"role": "user", "content": word(12)},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call-1", "content": word(20)}],
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _api_prompt(tokenizer, messages, **kw) -> list[int]:
    from types import SimpleNamespace

    from blockdraft.llm import LLM

    return LLM.encode_chat(SimpleNamespace(tokenizer=tokenizer), copy.deepcopy(messages), **kw)  # only .tokenizer is used


@pytest.mark.parametrize("case", sorted(PARITY))
def test_python_api_renders_the_same_prompt_ids_as_the_server(tokenizer, case):
    assert _api_prompt(tokenizer, PARITY[case]) == _prompt(tokenizer, PARITY[case])


def test_python_api_renders_tools_and_tool_calls_as_the_server_does(tokenizer):
    """Tools and a tool-call turn with its result reach the template the same way from LLM.chat's
    messages and the server's request; the template gets the call's arguments parsed (Qwen's writes
    `arguments | tojson`: an object, not a quoted string)."""
    api = _api_prompt(tokenizer, PARITY["tool-call"], tools=[WEATHER_TOOL])
    assert api == _prompt(tokenizer, PARITY["tool-call"], tools=[WEATHER_TOOL])
    if tokenizer.chat_template.startswith("{% for m in messages %}"):
        return  # the tiny template renders neither tools nor calls
    text = tokenizer.decode(api)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert f"<tool_response>\n{word(20)}\n</tool_response>" in text
    assert _api_prompt(tokenizer, PARITY["tool-call"]) != api  # without tools: no tools section


def test_python_api_passes_name_on_as_the_server_does(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['name'] | default('" + word(4) + "') }} {{ m['content'] }} {% endfor %}"
    api, server = _api_prompt(tok, PARITY["name"]), _prompt(tok, PARITY["name"])
    assert api == server and tok.decode(api).split()[:4] == [word(7), word(12), word(4), word(13)]


def test_add_generation_prompt_false_drops_the_assistant_cue(tokenizer):
    with_cue, without = _api_prompt(tokenizer, PARITY["name"]), _api_prompt(tokenizer, PARITY["name"], add_generation_prompt=False)
    assert with_cue != without and with_cue[:len(without)] == without  # the cue is a suffix
    if tokenizer.chat_template.startswith("{% for m in messages %}"):  # the tiny template: its cue is w03x
        assert tokenizer.decode(with_cue[len(without):]).split() == [word(3)]
    else:  # Qwen
        assert tokenizer.decode(with_cue[len(without):]) == "<|im_start|>assistant\n"
