"""A request with more choices (prompts x n) than --max-pending can ever admit gets 400, not a 429
that would send an OpenAI client retrying in vain."""

from __future__ import annotations

import pytest

from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import APIError
from blockdraft.server.params import build_plan
from blockdraft.server.protocol import CompletionRequest

MODEL = ModelInfo(name="t", vocab_size=100, max_model_len=64, kv_capacity_tokens=1024, num_speculative_tokens=0,
                  created=0, max_logprobs=20)


def test_choices_beyond_max_pending_are_a_400_naming_the_flag():
    config = ServerConfig(max_pending=4)
    assert len(build_plan(CompletionRequest(prompt=[[1], [2]], n=2, max_tokens=2), [[1], [2]], config, MODEL).params) == 4
    for prompts, n, what, param in (([[1]] * 5, 1, "5 prompts x n=1 = 5", "prompt"), ([[1]], 5, "1 prompt x n=5 = 5", "n"),
                                    ([[1], [2]], 3, "2 prompts x n=3 = 6", "n")):  # fmt: skip
        with pytest.raises(APIError, match=rf"^{what} choices, more than the server's --max-pending 4 engine requests "
                                            r"in flight: send at most 4 choices per request$") as e:
            build_plan(CompletionRequest(prompt=prompts, n=n, max_tokens=2), prompts, config, MODEL)
        assert e.value.status == 400 and e.value.param == param


def test_max_pending_alone_caps_the_choices_of_one_request():
    """--max-n and --max-pending are the only limits on choices: 100 prompts x n=20 fit a server
    whose --max-pending admits 2,000 (no hidden per-request cap below it)."""
    prompts = [[i % 90 + 1] for i in range(100)]
    config = ServerConfig(max_n=20, max_pending=2000)
    assert len(build_plan(CompletionRequest(prompt=prompts, n=20, max_tokens=2), prompts, config, MODEL).params) == 2000
    with pytest.raises(APIError, match=r"^n must be <= 20 \(the server's --max-n\), got 21$"):
        build_plan(CompletionRequest(prompt=prompts[:1], n=21, max_tokens=2), prompts[:1], config, MODEL)
