"""Top-level request fields as a vLLM client sends them (protocol.parse_request, no server): null
fields of any name are dropped; OpenAI's / vLLM's fields that never change the output are
type-checked and ignored; vLLM's extras are accepted at their defaults and refused by name
otherwise; a chat prompt over the context is worded about the messages."""

from __future__ import annotations

import pytest

from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import APIError
from blockdraft.server.params import build_plan
from blockdraft.server.protocol import (UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                        parse_request)

MESSAGES = [{"role": "user", "content": "hi"}]
BODIES = {ChatCompletionRequest: {"messages": MESSAGES}, CompletionRequest: {"prompt": "hi"}}
BOTH = pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])


def _parse(cls, **fields):
    return parse_request(cls, {**BODIES[cls], **fields})


def _refusal(cls, **fields) -> APIError:
    with pytest.raises(APIError) as e:
        _parse(cls, **fields)
    assert e.value.status == 400
    return e.value


@BOTH
def test_a_null_field_of_any_name_is_dropped(cls):
    nulls = dict(chat_template=None, documents=None, kv_transfer_params=None, mm_processor_kwargs=None,
                 frobnicate=None, guided_json=None)
    assert _parse(cls, **nulls) == _parse(cls)
    error = _refusal(cls, frobnicate=1)  # typo protection stays for non-null values
    assert error.param == "frobnicate" and "null is ignored" in error.message


@BOTH
def test_fields_that_never_change_the_output_are_accepted_whatever_their_value(cls):
    ignored = dict(prompt_cache_key="k1", safety_identifier="s1", user="u1", store=True, metadata={"run": "7"})
    req = _parse(cls, **ignored)
    assert (req.store, req.metadata) == (True, {"run": "7"})
    assert _parse(cls, store=False).store is False


@BOTH
@pytest.mark.parametrize("field, value, words", [
    ("prompt_cache_key", 5, "valid string"),
    ("safety_identifier", ["a"], "valid string"),
    ("user", 5, "valid string"),
    ("store", "yes", "valid boolean"),
    ("metadata", ["a"], "valid dictionary"),
    ("metadata", {"run": 7}, "valid string"),
    ("request_id", 5, "valid string"),
    ("request_id", "", "at least 1 character"),
    ("request_id", "a\nb", "printable"),
])
def test_a_wrong_type_is_a_400_naming_the_field_and_the_type(cls, field, value, words):
    error = _refusal(cls, **{field: value})
    assert error.param.split(".")[0] == field and field in error.message and words in error.message


@BOTH
def test_request_id_is_kept_for_the_response_id(cls):
    assert _parse(cls, request_id="trace-42").request_id == "trace-42"
    assert _parse(cls).request_id is None  # the server draws a random one


NEUTRAL = dict(vllm_xargs={}, mm_processor_kwargs={}, media_io_kwargs={}, documents=[], return_token_ids=False,
               logits_processors=[], verbosity="medium", include_reasoning=True, kv_transfer_params={})


@BOTH
def test_vllm_extras_at_their_defaults_are_accepted(cls):
    assert _parse(cls, **NEUTRAL) == _parse(cls)


@BOTH
@pytest.mark.parametrize("field, value, allowed", [
    ("vllm_xargs", {"k": 1}, "{} or null"),
    ("mm_processor_kwargs", {"k": 1}, "{} or null"),
    ("documents", [{"title": "a", "text": "b"}], "[] or null"),
    ("return_token_ids", True, "false or null"),
    ("logits_processors", ["x"], "[] or null"),
    ("verbosity", "high", '"medium" or null'),
    ("chat_template", "{{ messages }}", "only null"),
    ("cache_salt", "salt", "only null"),
])
def test_vllm_extras_at_other_values_are_refused_by_name(cls, field, value, allowed):
    error = _refusal(cls, **{field: value})
    assert error.param == field
    assert error.message.startswith(f"'{field}' is not supported by this server (only ") and allowed in error.message


def test_the_neutral_values_live_in_one_table():
    for field in ("vllm_xargs", "mm_processor_kwargs", "documents", "return_token_ids", "logits_processors",
                  "verbosity", "priority"):
        assert field in UNSUPPORTED_FIELDS


@BOTH
def test_priority_other_than_0_says_priority_scheduling_is_not_supported(cls):
    assert _parse(cls, priority=0) == _parse(cls)
    error = _refusal(cls, priority=3)
    assert error.param == "priority"
    assert error.message == ("'priority' is not supported: priority scheduling is not supported by this server "
                             "(only 0 or null is accepted), got 3")


def test_reasoning_effort_is_checked_on_chat_and_refused_on_completions():
    assert _parse(ChatCompletionRequest, reasoning_effort="low").reasoning_effort == "low"
    error = _refusal(ChatCompletionRequest, reasoning_effort="hihg")
    assert error.param == "reasoning_effort" and '"low"' in error.message and '"hihg"' in error.message
    error = _refusal(CompletionRequest, reasoning_effort="low")
    assert error.param == "reasoning_effort" and "chat template variable" in error.message
    # /tokenize with messages renders as chat does: the same field, the same check
    tokenize = parse_request(TokenizeRequest, {"messages": MESSAGES, "reasoning_effort": "high"})
    assert tokenize.reasoning_effort == "high"
    with pytest.raises(APIError) as e:
        parse_request(TokenizeRequest, {"messages": MESSAGES, "reasoning_effort": "hihg"})
    assert e.value.param == "reasoning_effort"


@BOTH
def test_stream_options_take_the_openai_sdks_include_obfuscation(cls):
    options = {"include_usage": True, "include_obfuscation": False}
    assert _parse(cls, stream=True, stream_options=options).stream_options.include_obfuscation is False
    error = _refusal(cls, stream=True, stream_options={"include_usage": True, "frobnicate": 1})
    assert error.param == "stream_options.frobnicate"


MODEL = ModelInfo(name="t", vocab_size=100, max_model_len=64, kv_capacity_tokens=1024, num_speculative_tokens=0,
                  created=0, max_logprobs=20)


def _plan_error(req, prompt_len: int) -> APIError:
    with pytest.raises(APIError) as e:
        build_plan(req, [[1] * prompt_len], ServerConfig(), MODEL)
    return e.value


def test_a_chat_prompt_over_the_context_is_worded_about_the_messages():
    error = _plan_error(ChatCompletionRequest(messages=MESSAGES), 70)
    assert error.param == "messages"
    assert error.message.startswith("the messages rendered with the chat template are 70 tokens; this model's "
                                    "context is 64 tokens (max_model_len in /v1/models), so at most 63 prompt tokens")
    error = _plan_error(ChatCompletionRequest(messages=MESSAGES, max_tokens=10), 60)
    assert error.param == "max_tokens"
    assert error.message.startswith("the messages rendered with the chat template are 60 tokens and max_tokens is 10")
    assert "lower max_tokens to at most 4" in error.message
    # completions keep naming the prompt by its index
    assert _plan_error(CompletionRequest(prompt=[1]), 70).message.startswith("prompt 0 has 70 tokens; ")
