"""vLLM's request fields and defaults a vLLM client relies on: max_tokens left out or null (completions
16 when left out, the rest of the context when null; chat the rest of the context either way, capped
by the server's limit), temperature without OpenAI's cap of 2, completions' add_special_tokens."""

from __future__ import annotations

import pytest

from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import APIError
from blockdraft.server.params import build_plan, completion_prompts
from blockdraft.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

MODEL = ModelInfo(name="t", vocab_size=100, max_model_len=64, kv_capacity_tokens=1024, num_speculative_tokens=0,
                  created=0, max_logprobs=20)
MESSAGES = [{"role": "user", "content": "hi"}]


def _max_tokens(req, config=None) -> int:
    plan = build_plan(req, [[1, 2, 3, 4]], config or ServerConfig(), MODEL)
    return plan.params[0].max_tokens


def test_completions_default_to_16_when_left_out_and_to_the_context_when_null():
    assert _max_tokens(CompletionRequest(prompt=[1, 2, 3, 4])) == 16
    assert _max_tokens(CompletionRequest(prompt=[1, 2, 3, 4], max_tokens=None)) == 60  # 64 - 4 prompt tokens
    assert _max_tokens(CompletionRequest(prompt=[1, 2, 3, 4], max_tokens=None), ServerConfig(max_tokens_limit=10)) == 10


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}])
def test_chat_defaults_to_the_rest_of_the_context(fields):
    assert _max_tokens(ChatCompletionRequest(messages=MESSAGES, **fields)) == 60


def test_temperature_has_no_upper_bound_as_in_vllm():
    assert build_plan(CompletionRequest(prompt=[1], temperature=5.0), [[1]], ServerConfig(), MODEL).params[0].temperature == 5.0


class _BosTokenizer:
    """Adds a BOS (id 1) unless add_special_tokens=False; one id per character otherwise."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [2 + ord(c) % 90 for c in text]


def test_completions_add_special_tokens_as_vllm():
    on = completion_prompts(CompletionRequest(prompt="ab"), _BosTokenizer(), MODEL)
    off = completion_prompts(CompletionRequest(prompt="ab", add_special_tokens=False), _BosTokenizer(), MODEL)
    assert on == [[1, *off[0]]] and len(off[0]) == 2
    ids = completion_prompts(CompletionRequest(prompt=[5, 6], add_special_tokens=False), _BosTokenizer(), MODEL)
    assert ids == [[5, 6]]  # token ids are taken as given


def test_chat_takes_add_special_tokens_only_at_its_default():
    """The chat template writes the special tokens: vLLM's chat default false is accepted, true refused by name."""
    ok = parse_request(ChatCompletionRequest, {"messages": MESSAGES, "add_special_tokens": False})
    assert ok.messages
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, {"messages": MESSAGES, "add_special_tokens": True})
    assert e.value.param == "add_special_tokens"
