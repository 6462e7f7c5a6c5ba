"""vLLM's chat-template controls on /v1/chat/completions: add_generation_prompt,
continue_final_message, chat_template_kwargs and OpenAI's reasoning_effort reach the tokenizer's
chat template (params.chat_prompt); conflicting or reserved values are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from blockdraft.server.errors import APIError
from blockdraft.server.params import chat_prompt
from blockdraft.server.protocol import ChatCompletionRequest, parse_request
from tests.server.conftest import MODEL_NAME
from tests.server.tiny_model import make_tokenizer, word

USER = {"role": "user", "content": "w05x"}
PARTIAL = {"role": "assistant", "content": "w06x w07x"}


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    # w09x marks the variable: rendered only when the request's chat_template_kwargs sets it
    tok.chat_template = tok.chat_template + "{% if think %} w09x{% endif %}"
    return tok


def _ids(tokenizer, **fields) -> list[int]:
    return chat_prompt(parse_request(ChatCompletionRequest, {"messages": [USER], **fields}), tokenizer)


def _words(ids) -> list[str]:
    return [word(i) for i in ids]


def test_template_controls_reach_the_template(tokenizer):
    assert _words(_ids(tokenizer)) == ["w02x", "w05x", "w03x"]  # user turn, then the assistant cue
    assert _words(_ids(tokenizer, add_generation_prompt=False)) == ["w02x", "w05x"]
    assert _words(_ids(tokenizer, chat_template_kwargs={"think": True})) == ["w02x", "w05x", "w03x", "w09x"]
    assert _ids(tokenizer, chat_template_kwargs={}) == _ids(tokenizer)
    req = parse_request(ChatCompletionRequest, {"messages": [USER, PARTIAL], "add_generation_prompt": False,
                                                "continue_final_message": True})
    assert _words(chat_prompt(req, tokenizer)) == ["w02x", "w05x", "w03x", "w06x", "w07x"]  # left open


@pytest.mark.parametrize("fields, match", [
    ({"continue_final_message": True}, "continue_final_message and add_generation_prompt cannot both be true"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "must be an assistant message; it is a 'user'"),
    ({"chat_template_kwargs": {"tokenize": True, "chat_template": "x"}}, "may not set chat_template, tokenize"),
    ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
])
def test_conflicts_and_reserved_arguments_are_refused_by_name(tokenizer, fields, match):
    with pytest.raises(APIError, match=match) as e:
        _ids(tokenizer, **fields)
    assert e.value.status == 400 and e.value.param in ("continue_final_message", "chat_template_kwargs")


def test_the_server_takes_them(plain_server):
    headers = plain_server.headers()
    body = {"model": MODEL_NAME, "messages": [USER, PARTIAL], "max_tokens": 2, "temperature": 0}
    cue = httpx.post(plain_server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    cont = httpx.post(plain_server.url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={**body, "add_generation_prompt": False, "continue_final_message": True,
                            "chat_template_kwargs": {"enable_thinking": False}})
    assert cue.status_code == cont.status_code == 200, (cue.text, cont.text)
    # the continued prompt lacks the final assistant cue: one token fewer
    assert cont.json()["usage"]["prompt_tokens"] == cue.json()["usage"]["prompt_tokens"] - 1


def test_a_template_that_cannot_continue_names_continue_final_message():
    """transformers refuses continue_final_message when the template rewrites the final message;
    the 400 names that field, not the messages."""
    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"  # w06x w07x -> W06X W07X
    req = parse_request(ChatCompletionRequest, {"messages": [USER, PARTIAL], "add_generation_prompt": False,
                                                "continue_final_message": True})
    with pytest.raises(APIError, match="the chat template rejected these messages") as e:
        chat_prompt(req, tok)
    assert e.value.status == 400 and e.value.param == "continue_final_message"


def test_reasoning_effort_reaches_the_template_as_a_variable():
    """vLLM gives chat's reasoning_effort to the template; chat_template_kwargs' own value wins."""
    tok = make_tokenizer()
    tok.chat_template += "{% if reasoning_effort == 'high' %} w09x{% elif reasoning_effort %} w08x{% endif %}"
    assert _words(_ids(tok))[-1] == "w03x"  # not given: the template sees no variable
    assert _words(_ids(tok, reasoning_effort="high"))[-1] == "w09x"
    assert _words(_ids(tok, reasoning_effort="low"))[-1] == "w08x"
    both = _ids(tok, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low", "think": True})
    assert _words(both)[-1] == "w08x"


def test_no_chat_template_points_to_completions():
    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(APIError, match="no chat template; use /v1/completions") as e:
        _ids(tok)
    assert e.value.param == "messages"


def test_the_answer_continues_the_last_turns_role_without_a_generation_prompt(plain_server):
    """vLLM's get_chat_request_role: add_generation_prompt false answers in the last message's role
    (whole and streamed); with the assistant cue, or continuing an assistant turn, "assistant"."""
    url, headers = plain_server.url + "/v1/chat/completions", plain_server.headers()
    body = {"model": MODEL_NAME, "messages": [USER], "max_tokens": 2, "temperature": 0}
    roles = {}
    for name, over in {"cue": {}, "no cue": {"add_generation_prompt": False},
                       "continue": {"messages": [USER, PARTIAL], "add_generation_prompt": False,
                                    "continue_final_message": True}}.items():
        r = httpx.post(url, json={**body, **over}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", url, json={**body, **over, "stream": True}, headers=headers, timeout=60) as s:
            first = next(line for line in s.iter_lines() if line.startswith("data: {"))
        roles[name] = (r.json()["choices"][0]["message"]["role"], json.loads(first[6:])["choices"][0]["delta"]["role"])
    assert roles == {"cue": ("assistant",) * 2, "no cue": ("user",) * 2, "continue": ("assistant",) * 2}
