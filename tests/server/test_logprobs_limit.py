"""The server accepts at most the smaller of its own max_logprobs and the engine's (a request the
engine would refuse gets the server's 400 naming the field), and `serve --max-logprobs N` sets both."""

from __future__ import annotations

import pytest

from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import APIError
from blockdraft.server.params import build_plan
from blockdraft.server.protocol import ChatCompletionRequest, CompletionRequest


def _model(max_logprobs: int) -> ModelInfo:
    return ModelInfo(name="t", vocab_size=100, max_model_len=64, kv_capacity_tokens=1024, num_speculative_tokens=0,
                     created=0, max_logprobs=max_logprobs)


@pytest.mark.parametrize("server_limit, engine_limit", [(20, 5), (5, 20)])
def test_the_smaller_limit_applies(server_limit, engine_limit):
    config, model = ServerConfig(max_logprobs=server_limit), _model(engine_limit)
    ok = build_plan(CompletionRequest(prompt=[1, 2], logprobs=5, max_tokens=2), [[1, 2]], config, model)
    assert ok.params[0].logprobs == 5
    with pytest.raises(APIError, match=r"^logprobs must be <= 5 \(the server's --max-logprobs\), got 6$") as e:
        build_plan(CompletionRequest(prompt=[1, 2], logprobs=6, max_tokens=2), [[1, 2]], config, model)
    assert e.value.status == 400 and e.value.param == "logprobs"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=6)
    with pytest.raises(APIError, match=r"^top_logprobs must be <= 5 \(the server's --max-logprobs\), got 6$"):
        build_plan(chat, [[1, 2]], config, model)


class _Built(Exception):
    """Raised by the stand-in LLM: serve got as far as building the engine."""


def test_serve_max_logprobs_sets_the_server_and_the_engine_limit(monkeypatch):
    import blockdraft.llm
    from blockdraft.cli import _parser
    from blockdraft.server.launch import config_from_args, serve

    def fake_llm(**kwargs):
        raise _Built(kwargs)

    monkeypatch.setattr(blockdraft.llm, "LLM", fake_llm)
    args = _parser().parse_args(["serve", "--model", "somewhere", "--no-draft", "--max-logprobs", "5"])
    assert config_from_args(args).max_logprobs == 5
    with pytest.raises(_Built) as built:
        serve(args)
    assert built.value.args[0]["max_logprobs"] == 5
    default = _parser().parse_args(["serve", "--no-draft"])
    assert config_from_args(default).max_logprobs == 20

