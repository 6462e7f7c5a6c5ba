"""Chat message checks (blockdraft.chat_messages), shared by the Python API and the server."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from blockdraft.server.errors import APIError
from blockdraft.server.protocol import ChatCompletionRequest, parse_request
from tests.server.tiny_model import write_tiny_model

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
        ([{"role": "user", "content": 5}], "chat message 0: content must be a string, got int"),
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
        ({"role": "user", "content": "w05x"}, "prompts must be a str, a list of token ids, .* got dict"),
        (5, "prompts must be a str, .* got int 5"),
        ([None], "prompt 0 must be a str, a list of token ids or a conversation .* got NoneType None"),
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
