"""Chat message checks (blockdraft.chat_messages), shared by the Python API and the server."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from blockdraft.server.errors import APIError
from blockdraft.server.params import chat_prompt
from blockdraft.server.protocol import ChatCompletionRequest, parse_request
from tests.server.tiny_model import word, write_tiny_model

ALLOWED = "allowed roles: 'system', 'user', 'assistant'"
OK = {"role": "user", "content": "w05x w17x"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # the tiny model's chat template renders any role: only our check can refuse one
    return LLM(model=str(write_tiny_model(tmp_path_factory.mktemp("chat") / "model")))


@pytest.mark.parametrize(
    "messages, match",
    [
        ([OK, {"role": "robot", "content": "w05x"}], rf"chat message 1: role 'robot' is not supported; {ALLOWED}"),
        ([{"content": "w05x"}], rf"chat message 0: role None is not supported; {ALLOWED}"),
        ([OK, OK, {"role": "user"}], r"chat message 2 has no 'content': \{'role': 'user'\}"),
        ([{"role": "user", "content": 5}], "chat message 0: content must be a string or a list of .* parts, got int"),
        ([OK, "w05x"], "chat message 1 must be a dict with 'role' and 'content', got 'w05x'"),
    ],
)
def test_api_refuses_bad_messages_naming_index_value_and_roles(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages)
    with pytest.raises(ValueError, match=match):
        llm.generate([[OK], messages])  # a bad conversation anywhere in the batch: nothing runs
    assert not llm.engine.has_unfinished_requests()


def test_api_accepts_every_allowed_role(llm):
    conv = [{"role": "system", "content": "w09x"}, OK, {"role": "assistant", "content": "w03x"}, OK]
    assert llm.chat(conv, SamplingParams(max_tokens=2))[0].num_output_tokens == 2


def test_server_uses_the_same_role_check():
    body = {"messages": [OK, {"role": "robot", "content": "w05x"}]}
    with pytest.raises(APIError, match=rf"invalid 'messages\[1\].role': role 'robot' is not supported; {ALLOWED}"):
        parse_request(ChatCompletionRequest, body)


@pytest.mark.parametrize(
    "messages, match",
    [
        ("w05x", r"LLM.chat takes a conversation .* got str 'w05x'; raw text goes to LLM.generate"),
        (None, r"LLM.chat takes a conversation .* got NoneType None"),
        (OK, r"LLM.chat takes a conversation .* got dict"),
        # a list of non-dicts is one conversation: the bad message is named whole, not its first character
        (["w05x w17x"], "chat message 0 must be a dict with 'role' and 'content', got 'w05x w17x'"),
        ([("user", "w05x")], r"chat message 0 must be a dict with 'role' and 'content', got \('user', 'w05x'\)"),
        ([[OK], "w05x"], "a chat conversation must be a list of .* got str 'w05x'"),
        ([[]], "chat conversation is empty"),
        ([[OK], []], "chat conversation is empty"),
    ],
)
def test_chat_refuses_other_shapes_naming_the_value(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages)
    assert not llm.engine.has_unfinished_requests()


def test_chat_of_no_conversations_gives_an_empty_list(llm, monkeypatch):
    """vLLM's LLM.chat([]) returns [] (a list of no conversations); ours too, without stepping."""
    monkeypatch.setattr(llm.engine, "step", lambda *a, **k: pytest.fail("the engine was stepped"))
    assert llm.chat([]) == [] and llm.chat(()) == []


@pytest.mark.parametrize(
    "prompts, match",
    [
        ({"role": "user", "content": "w05x"}, r"prompts is a single chat message .*: a conversation is a list of "
                                              r"messages, so give \[message, \.\.\.\] \(or use LLM.chat\)"),
        (5, "prompts must be a str, .* got int 5"),
        ([None], "prompt 0 must be a str, a list of token ids, a prompt dict or a conversation .* got NoneType None"),
        (["w05x", 7.5], "prompt 1 must be a str, .* got float 7.5"),
        ([[3, 4.7]], "prompt 0: token 1 must be an integer token id, got float 4.7"),  # never rounded
        ([[3, "w05x"]], "prompt 0: token 1 must be an integer token id, got str 'w05x'"),
        ([[3, True]], "prompt 0: token 1 must be an integer token id, got bool True"),
        ([[OK], [1.0]], "prompt 1: token 0 must be an integer token id, got float 1.0"),
        ("", "prompt 0 is empty: give a non-empty string"),
        (["w05x", ""], "prompt 1 is empty: give a non-empty string"),
        ([[5], []], "prompt 1 is empty: give at least one token id"),
    ],
)
def test_generate_refuses_other_prompt_shapes_naming_the_value(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts)
    assert not llm.engine.has_unfinished_requests()


def test_generate_takes_one_list_of_token_ids(llm):
    """A flat list of token ids is one prompt (as the server's prompt field takes it), the same as
    a list holding it; numpy / 0-d tensor integers are token ids too."""
    import numpy as np
    import torch

    params = SamplingParams(max_tokens=3)
    ids = llm.tokenizer.encode("w05x w17x")
    ref = llm.generate([ids], params)
    assert len(ref) == 1
    for prompts in (ids, [ids], [[np.int64(t) for t in ids]], [[torch.tensor(t) for t in ids]]):
        assert [o.token_ids for o in llm.generate(prompts, params)] == [ref[0].token_ids]


def test_get_tokenizer_is_the_models_tokenizer(llm):
    """vLLM's LLM.get_tokenizer()."""
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer and tok.decode(tok.encode("w05x w17x")) == "w05x w17x"


def test_chat_takes_what_the_server_takes(llm):
    """developer (rendered as system), text parts (joined by newlines) and name, through LLM.chat."""
    params = SamplingParams(max_tokens=3)
    server_shaped = [{"role": "developer", "content": [{"type": "text", "text": "w09x"}, {"type": "text", "text": "w10x"}]},
                     {"role": "user", "content": "w05x", "name": "alice"}]
    plain = [{"role": "system", "content": "w09x\nw10x"}, {"role": "user", "content": "w05x"}]
    out, ref = llm.chat(server_shaped, params)[0], llm.chat(plain, params)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids and out.token_ids == ref.token_ids
    assert [o.token_ids for o in llm.generate([server_shaped, "w05x"], params)][0] == ref.token_ids


def test_chat_add_generation_prompt(llm):
    """vLLM's keyword, passed on to the template: False leaves out the assistant cue (w03x here)."""
    params = SamplingParams(max_tokens=2)
    conv = [{"role": "user", "content": "w05x w17x"}]
    cued, bare = llm.chat(conv, params)[0], llm.chat(conv, params, add_generation_prompt=False)[0]
    assert llm.tokenizer.decode(cued.prompt_token_ids).split() == ["w02x", "w05x", "w17x", "w03x"]
    assert bare.prompt_token_ids == cued.prompt_token_ids[:-1]
    assert llm.chat([conv, conv], params, add_generation_prompt=False)[1].prompt_token_ids == bare.prompt_token_ids
    with pytest.raises(ValueError, match="add_generation_prompt must be True or False, got str 'no'"):
        llm.chat(conv, params, add_generation_prompt="no")


def test_chat_continue_final_message_and_template_kwargs(llm):
    """vLLM's LLM.chat keywords, rendered as the server renders them (render_chat): the final
    assistant message left open; extra template variables reach the template."""
    llm.tokenizer.chat_template += "{% if think %} w09x{% endif %}"  # module-scoped model: undone below
    try:
        params = SamplingParams(max_tokens=2)
        conv = [{"role": "user", "content": "w05x"}, {"role": "assistant", "content": "w06x w07x"}]
        out = llm.chat(conv, params, add_generation_prompt=False, continue_final_message=True)[0]
        assert llm.tokenizer.decode(out.prompt_token_ids).split() == ["w02x", "w05x", "w03x", "w06x", "w07x"]
        req = parse_request(ChatCompletionRequest, {"messages": conv, "add_generation_prompt": False,
                                                    "continue_final_message": True})
        assert out.prompt_token_ids == chat_prompt(req, llm.tokenizer)
        user = conv[:1]
        think = llm.chat(user, params, chat_template_kwargs={"think": True})[0]
        assert llm.tokenizer.decode(think.prompt_token_ids).split() == ["w02x", "w05x", "w03x", "w09x"]
        for kw, match in [({"continue_final_message": True}, "cannot both be true"),
                          ({"continue_final_message": True, "add_generation_prompt": False},
                           "must be an assistant message; it is a 'user'"),
                          ({"continue_final_message": 1}, "continue_final_message must be True or False, got int 1"),
                          ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
                          ({"chat_template_kwargs": ["think"]}, "chat_template_kwargs must be a dict .*, got list")]:
            with pytest.raises(ValueError, match=match):
                llm.chat(user, params, **kw)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.tokenizer.chat_template = llm.tokenizer.chat_template.removesuffix("{% if think %} w09x{% endif %}")


def test_chat_without_a_template_points_to_generate(llm):
    saved, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="this model has no chat template; give LLM.generate a plain text prompt"):
            llm.chat([OK])
    finally:
        llm.tokenizer.chat_template = saved


@pytest.mark.parametrize(
    "message, match",
    [
        ({"role": "user", "content": "w05x", "tools": []},
         r"chat message 0 has keys \['tools'\] that are not supported; a message's keys are 'role', 'content', 'name', "
         r"'tool_calls', 'tool_call_id'"),
        ({"role": "user", "content": "w05x", "tool_calls": [{"id": "c1"}]},
         "chat message 0: tool_calls is only allowed in assistant messages, not in a 'user' message"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{x"}}]},
         r"chat message 0: tool_calls\[0\]\.function\.arguments is not valid JSON"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "[1]"}}]},
         r"chat message 0: tool_calls\[0\]\.function\.arguments must be the JSON text of an object, got \[1\]"),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
         r"chat message 0: tool_calls\[0\]\.id must be a non-empty string"),
        ({"role": "assistant", "content": None}, "chat message 0: content is required: only an assistant message with "
                                                 "tool_calls may have null content"),
        ({"role": "user", "content": "w05x", "tool_call_id": "c1"},
         "chat message 0: tool_call_id is only allowed in tool messages, not in a 'user' message"),
        ({"role": "tool", "content": "w05x"}, "chat message 0: a tool message needs tool_call_id"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
         "chat message 0: content part 0 has type 'image_url', which is not supported; only 'text' parts are"),
        ({"role": "user", "content": [{"type": "text"}]}, r"chat message 0: content part 0 must be \{'type': 'text', 'text': str\}"),
        ({"role": "user", "content": "w05x", "name": 5}, "chat message 0: name must be a string, got int 5"),
        ({"role": "user", "content": "w05x", "name": "x" * 257}, "chat message 0: name must be at most 256 characters, got 257"),
        ({"role": "robot", "content": "w05x"},
         "role 'robot' is not supported; allowed roles: 'system', 'user', 'assistant', 'developer', 'tool'"),
    ],
)
def test_api_refuses_what_the_server_refuses(llm, message, match):
    with pytest.raises(ValueError, match=match):
        llm.chat([message])
    assert not llm.engine.has_unfinished_requests()


def test_echoed_empty_assistant_keys_are_dropped_in_both(llm):
    """An assistant turn sent back as the OpenAI SDK dumps it (tool_calls / refusal / function_call /
    audio / annotations null or []) renders as without those keys, in the Python API and the
    server's request model; a value in one of them is refused by name in both."""
    turn = {"role": "assistant", "content": "w03x"}
    echoed = {**turn, "tool_calls": [], "refusal": None, "function_call": None, "audio": None, "annotations": None}
    params = SamplingParams(max_tokens=2)
    a, b = llm.chat([OK, echoed, OK], params)[0], llm.chat([OK, turn, OK], params)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    req = parse_request(ChatCompletionRequest, {"messages": [OK, echoed]})
    assert req.messages[1].template_message() == {"role": "assistant", "content": "w03x"}
    with pytest.raises(ValueError, match=r"chat message 1: tool_calls\[0\]\.function must be"):
        llm.chat([OK, {**turn, "tool_calls": [{"id": "c1"}]}])
    with pytest.raises(APIError, match=r"audio is not supported"):
        parse_request(ChatCompletionRequest, {"messages": [{**turn, "audio": {"id": "a"}}]})


def test_chat_takes_tools_and_refuses_bad_ones_naming_them(llm):
    """LLM.chat(tools=...) gives the template the checked tools (vLLM's keyword); bad ones are
    refused as the server refuses them, before anything is queued."""
    tool = {"type": "function", "function": {"name": word(44), "parameters": {"type": "object"}}}  # a word of the vocabulary
    saved = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = saved + "{% for t in tools or [] %} {{ t.function.name }}{% endfor %}"
    try:
        with_tools = llm.encode_chat([OK], tools=[tool])
        assert llm.tokenizer.decode(with_tools).endswith(word(44)) and with_tools != llm.encode_chat([OK])
        for tools, match in (([tool, tool], rf"tools\[1\]\.function\.name '{word(44)}' is also the name of tools\[0\]"),
                             ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                              r"tools\[0\]\.function\.parameters must be a JSON Schema of an object")):
            with pytest.raises(ValueError, match=match):
                llm.chat([OK], SamplingParams(max_tokens=2), tools=tools)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.tokenizer.chat_template = saved


def test_an_assistant_message_as_the_openai_sdk_returns_it_is_taken():
    """Agent loops append the SDK's own message: .parse() adds `parsed`, a stream accumulation
    adds each call's `index`, .parse() with tools adds `parsed_arguments`: derived data, dropped."""
    from blockdraft.chat_messages import check_tool_calls, drop_echoed_empty_keys

    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}}}
    message = {"role": "assistant", "content": '{"x": 1}', "parsed": {"x": 1}, "refusal": None, "tool_calls": [call]}
    assert drop_echoed_empty_keys(message) == {"role": "assistant", "content": '{"x": 1}', "tool_calls": [call]}
    assert check_tool_calls([call]) == [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    req = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "q"}, message,
                                                             {"role": "tool", "tool_call_id": "c1", "content": "1"}]})
    assert len(req.messages) == 3


def test_tool_call_arguments_nested_too_deeply_are_a_value_error():
    from blockdraft.chat_messages import check_tool_calls

    deep = "[" * 3000 + "]" * 3000
    with pytest.raises(ValueError, match=r"tool_calls\[0\].function.arguments is nested too deeply"):
        check_tool_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}])
