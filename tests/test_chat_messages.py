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
