"""`serve --generation-config` (vLLM's): request fields left out or null take the model's
generation_config.json defaults, values sent win; `vllm` ignores the file; a FOLDER's max_new_tokens
caps every request; a bad value stops the start naming the key; the start-up warning line."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.params import build_plan
from blockdraft.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from tests.server.server_process import STARTUP_TIMEOUT_S, start_server, stop_server, wait_ready
from tests.server.tiny_model import write_tiny_model

QWEN25 = {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
MESSAGES = [{"role": "user", "content": "hi"}]


def _model(default_sampling=None, cap=None) -> ModelInfo:
    return ModelInfo(name="t", vocab_size=100, max_model_len=64, kv_capacity_tokens=1024, num_speculative_tokens=0,
                     created=0, max_logprobs=20, default_sampling=default_sampling or {}, max_tokens_cap=cap)


def _params(body: dict, model: ModelInfo, cls=ChatCompletionRequest):
    req = parse_request(cls, {"messages": MESSAGES, **body} if cls is ChatCompletionRequest else {"prompt": [1], **body})
    return build_plan(req, [[1, 2, 3, 4]], ServerConfig(), model).params[0]


def _fields(p) -> tuple:
    return p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_fields_left_out_or_null_take_the_model_defaults(cls):
    model = _model({**QWEN25, "min_p": 0.05})
    assert _fields(_params({}, model, cls)) == (0.7, 0.8, 20, 0.05, 1.05)
    nulls = dict(temperature=None, top_p=None, top_k=None, min_p=None, repetition_penalty=None)
    assert _fields(_params(nulls, model, cls)) == (0.7, 0.8, 20, 0.05, 1.05)  # null: the default, as vLLM
    sent = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert _fields(_params(sent, model, cls)) == (0.0, 1.0, 0, 0.0, 1.0)  # sent values win, the neutral ones too
    assert _fields(_params({"temperature": 0.2}, model, cls)) == (0.2, 0.8, 20, 0.05, 1.05)  # one field at a time
    assert _fields(_params({}, _model(), cls)) == (1.0, 1.0, 0, 0.0, 1.0)  # no file: OpenAI's defaults


def test_max_new_tokens_is_the_default_max_tokens():
    model = _model({"max_tokens": 7})
    assert _params({}, model).max_tokens == 7  # chat left out
    assert _params({"max_tokens": None}, model).max_tokens == 7
    assert _params({"max_tokens": 30}, model).max_tokens == 30  # sent: wins (auto sets a default, not a cap)
    assert _params({}, model, CompletionRequest).max_tokens == 16  # completions' field defaults to 16 (vLLM)
    assert _params({"max_tokens": None}, model, CompletionRequest).max_tokens == 7
    assert _params({}, _model({"max_tokens": 500})).max_tokens == 60  # within the context left (64 - 4)


def test_a_folders_max_new_tokens_caps_every_request():
    model = _model({"max_tokens": 7}, cap=7)
    assert _params({"max_tokens": 30}, model).max_tokens == 7
    assert _params({"max_tokens": 30}, model, CompletionRequest).max_tokens == 7
    assert _params({"max_tokens": 3}, model).max_tokens == 3


def test_model_info_reads_the_llm_and_v1_models_shows_nothing_new(tmp_path, llama_target):
    import dataclasses

    from blockdraft.server.api import _model_card, model_info
    from tests.conftest import make_llm

    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN25, "max_new_tokens": 9}))
    config = ServerConfig(served_model_name="t")
    auto = make_llm(dataclasses.replace(llama_target, path=str(tmp_path)))
    info = model_info(auto, config)
    assert info.default_sampling == {**QWEN25, "max_tokens": 9} and info.max_tokens_cap is None
    assert set(_model_card(info)) == {"id", "object", "created", "owned_by", "max_model_len"}
    off = model_info(make_llm(dataclasses.replace(llama_target, path=str(tmp_path)), generation_config="vllm"), config)
    assert off.default_sampling == {} and off.max_tokens_cap is None
    folder = model_info(make_llm(llama_target, generation_config=str(tmp_path)), config)
    assert folder.default_sampling == info.default_sampling and folder.max_tokens_cap == 9


def test_a_bad_value_stops_the_start_naming_the_key_before_the_weights_load(tmp_path, capsys, monkeypatch):
    import blockdraft.model_loader
    from blockdraft.cli import main

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    model = write_tiny_model(tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0}))
    assert main(["serve", "--model", str(model), "--no-draft", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {model}/generation_config.json: top_p must be a number in (0, 1], got 0") and \
        'give generation_config (--generation-config) "vllm"' in err and err.count("\n") == 1, err
    assert main(["serve", "--model", str(model), "--no-draft", "--port", "0", "--generation-config", "/nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: generation_config (--generation-config) must be \"auto\"") and "'/nope'" in err, err


def test_a_served_model_applies_its_file_and_says_so_at_start(tmp_path):
    """A tiny HF folder whose generation_config.json sets greedy decoding and 3 output tokens: a
    chat request that sends neither gets 3 tokens, twice the same answer; one that sends them wins."""
    model = write_tiny_model(tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0, "max_new_tokens": 3, "top_k": 20}))
    server = start_server(model, tmp_path / "serve.log", "--no-draft", log_level="info")
    try:
        wait_ready(server, STARTUP_TIMEOUT_S)
        body = {"model": "tiny", "messages": MESSAGES, "ignore_eos": True}

        def chat(**fields):
            r = httpx.post(server.url + "/v1/chat/completions", json={**body, **fields}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        first, second = chat(), chat()
        assert first["usage"]["completion_tokens"] == 3 and first["choices"][0]["finish_reason"] == "length"
        assert first["choices"][0]["message"] == second["choices"][0]["message"]  # temperature 0 from the file
        assert chat(max_tokens=5)["usage"]["completion_tokens"] == 5
        deadline = time.monotonic() + 10
        while "Default sampling parameters" not in server.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        line = next(x for x in server.log.read_text().splitlines() if "Default sampling parameters" in x)
        assert "WARNING" in line and "{'temperature': 0.0, 'top_k': 20, 'max_tokens': 3}" in line
        assert str(model / "generation_config.json") in line and "--generation-config vllm" in line
    finally:
        stop_server(server)
