"""The model's sampling defaults from generation_config.json (vLLM's --generation-config auto):
which keys are read, the "vllm" and folder modes, values refused by name, catalog (GGUF) folders
unchanged, and `LLM.generate` without SamplingParams using them."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest

from blockdraft.generation_config import default_sampling_params
from blockdraft.sampling_params import SamplingParams
from blockdraft.weights.fetch import MARKER
from tests.conftest import make_llm

# Qwen2.5-7B-Instruct's generation_config.json, as released
QWEN25 = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
          "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
          "transformers_version": "4.37.0"}
QWEN25_DEFAULTS = {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def _write(folder, config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config) if isinstance(config, dict) else config)
    return str(folder)


def test_qwen25_defaults_are_read_and_other_keys_ignored(tmp_path):
    got = default_sampling_params(_write(tmp_path, QWEN25))
    assert got == QWEN25_DEFAULTS and list(got) == list(QWEN25_DEFAULTS)  # vLLM's order, as the log line shows
    both = {"min_p": 0.05, "max_new_tokens": 512, "temperature": None, "frobnicate": -3, "max_length": 20}
    assert default_sampling_params(_write(tmp_path, both)) == {"min_p": 0.05, "max_tokens": 512}  # null: left out


def test_vllm_mode_ignores_the_file_and_a_folder_reads_its_own(tmp_path):
    model = _write(tmp_path / "model", {"temperature": -1})  # a bad value is not even read
    assert default_sampling_params(model, "vllm") == {}
    other = _write(tmp_path / "other", {"temperature": 0.3, "max_new_tokens": 8})
    assert default_sampling_params(model, other) == {"temperature": 0.3, "max_tokens": 8}


@pytest.mark.parametrize("value, words", [
    ("/nonexistent-folder", "which is not a folder"),
    ("", "got ''"),
    (None, "got None"),
    ("AUTO", "which is not a folder"),
])
def test_a_bad_mode_is_refused_with_what_is_allowed(value, words):
    with pytest.raises(ValueError, match="generation_config must be \"auto\"") as e:
        default_sampling_params("/nowhere", value)
    assert words in str(e.value) and '"vllm" (none) or a folder holding a generation_config.json' in str(e.value)


def test_a_folder_without_the_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="which has no generation_config.json"):
        default_sampling_params("/nowhere", str(tmp_path))


@pytest.mark.parametrize("key, value, allowed", [
    ("temperature", -0.5, "a number >= 0"),
    ("temperature", "0.7", "a number >= 0"),
    ("temperature", True, "a number >= 0"),
    ("top_p", 0, r"a number in \(0, 1\]"),
    ("top_p", 1.5, r"a number in \(0, 1\]"),
    ("top_k", -2, "an integer >= -1"),
    ("top_k", 20.0, "an integer >= -1"),
    ("min_p", 2, r"a number in \[0, 1\]"),
    ("repetition_penalty", 0, "a number > 0"),
    ("max_new_tokens", 0, "an integer >= 1"),
])
def test_a_bad_value_is_refused_naming_the_file_key_value_and_range(tmp_path, key, value, allowed):
    folder = _write(tmp_path, {**QWEN25, key: value})
    with pytest.raises(ValueError, match=rf"generation_config.json: {key} must be {allowed}[^,]*, got "
                                         rf"{re.escape(json.dumps(value))} \(") as e:
        default_sampling_params(folder)
    assert str(tmp_path) in str(e.value) and 'generation_config "vllm" to ignore' in str(e.value)


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path):
    for text in ("[1, 2]", "{oops"):
        with pytest.raises(ValueError, match="generation_config.json is not a JSON object"):
            default_sampling_params(_write(tmp_path, text))


def test_a_catalog_folder_converted_from_gguf_has_no_defaults(tmp_path, llama_target):
    (tmp_path / MARKER).write_text(json.dumps({"name": "qwen2.5-coder-0.5b-instruct", "gguf": "/c/x.gguf"}))
    assert default_sampling_params(str(tmp_path)) == {}
    llm = make_llm(dataclasses.replace(llama_target, path=str(tmp_path)))
    assert llm.default_sampling_params == {} and llm.generation_config_file is None
    assert llm.get_default_sampling_params().temperature == 0.0  # SamplingParams' own: greedy, 256 tokens
    assert llm.get_default_sampling_params().max_tokens == 256


def _captured(llm) -> list[SamplingParams]:
    """Record the SamplingParams of each engine request the LLM queues."""
    seen, add = [], llm.engine.add_request
    llm.engine.add_request = lambda rid, toks, q: (seen.append(q), add(rid, toks, q))[1]
    return seen


def test_llm_generate_without_params_uses_the_model_defaults(tmp_path, llama_target, caplog):
    folder = _write(tmp_path, {**QWEN25, "max_new_tokens": 3})
    llm = make_llm(dataclasses.replace(llama_target, path=folder))
    assert llm.default_sampling_params == {**QWEN25_DEFAULTS, "max_tokens": 3}
    seen = _captured(llm)
    with caplog.at_level(logging.WARNING, logger="blockdraft.llm"):
        llm.generate([[1, 2, 3]])
        llm.generate([[4, 5], [6]])
        list(llm.generate_stream([1, 2, 3]))
    for q in seen:
        assert (q.temperature, q.top_p, q.top_k, q.repetition_penalty, q.max_tokens) == (0.7, 0.8, 20, 1.05, 3)
    assert len(seen) == 4
    said = [r.getMessage() for r in caplog.records if "Default sampling parameters" in r.getMessage()]
    assert len(said) == 1 and "'temperature': 0.7" in said[0] and folder in said[0], said  # once, as vLLM
    # SamplingParams given are used as they are (not merged with the defaults, as vLLM)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].repetition_penalty, seen[-1].max_tokens) == (0.0, 0, 1.0, 2)


def test_llm_vllm_mode_and_bad_values(tmp_path, llama_target):
    folder = _write(tmp_path, QWEN25)
    llm = make_llm(dataclasses.replace(llama_target, path=folder), generation_config="vllm")
    assert llm.default_sampling_params == {} and llm.get_default_sampling_params().temperature == 0.0
    _write(tmp_path, {**QWEN25, "top_k": -5})
    with pytest.raises(ValueError, match="top_k must be an integer >= -1 .* got -5"):
        make_llm(dataclasses.replace(llama_target, path=folder))
    with pytest.raises(ValueError, match="generation_config must be"):
        make_llm(llama_target, generation_config="hf")
