"""The stop ids a target decodes to (`model_loader.eos_token_ids`): config / tokenizer EOS, plus
generation_config.json's eos ids (vLLM) or, for a GGUF conversion, its end-of-generation special
tokens (llama.cpp)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from blockdraft.model_loader import LoadedTarget, eos_token_ids
from blockdraft.weights.fetch import MARKER


def _target(folder, config_eos=(151645,), tok_eos=151645, added=None):
    added = added if added is not None else {
        151643: SimpleNamespace(content="<|endoftext|>", special=True),
        151644: SimpleNamespace(content="<|im_start|>", special=True),
        151645: SimpleNamespace(content="<|im_end|>", special=True),
        151660: SimpleNamespace(content="<|fim_middle|>", special=True),
        9999: SimpleNamespace(content="<|end|>", special=False),  # not a special token: a word
    }
    tok = SimpleNamespace(eos_token_id=tok_eos, added_tokens_decoder=added)
    return LoadedTarget(SimpleNamespace(eos_token_ids=tuple(config_eos)), None, tok, str(folder))


def test_gguf_conversion_adds_its_special_end_markers(tmp_path):
    (tmp_path / MARKER).write_text(json.dumps({"name": "x", "gguf": "/c/x.gguf"}))
    assert eos_token_ids(_target(tmp_path)) == (151643, 151645)


def test_plain_folder_keeps_config_and_tokenizer_eos(tmp_path):
    assert eos_token_ids(_target(tmp_path)) == (151645,)  # an HF folder without generation_config: as vLLM
    (tmp_path / MARKER).write_text(json.dumps({"name": "x"}))  # a marker that names no GGUF
    assert eos_token_ids(_target(tmp_path)) == (151645,)


def test_generation_config_eos_ids_are_added(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643, 7]}))
    assert eos_token_ids(_target(tmp_path)) == (7, 151643, 151645)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert eos_token_ids(_target(tmp_path)) == (5, 151645)


def test_generation_config_wins_over_the_gguf_markers(tmp_path):
    (tmp_path / MARKER).write_text(json.dumps({"gguf": "/c/x.gguf"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert eos_token_ids(_target(tmp_path)) == (151645,)


@pytest.mark.parametrize("text, match", [
    ("{not json", "is not a JSON object"),
    ("[1, 2]", "is not a JSON object"),
    ('{"eos_token_id": "151643"}', "eos_token_id must be a token id >= 0 or a list of them, got '151643'"),
    ('{"eos_token_id": [1, -2]}', r"got \[1, -2\]"),
    ('{"eos_token_id": true}', "got True"),
])
def test_bad_generation_config_is_refused_by_name(tmp_path, text, match):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        eos_token_ids(_target(tmp_path))
    assert "generation_config.json" in str(e.value)


def test_a_model_built_in_memory_reads_no_files(tmp_path, monkeypatch):
    """A placeholder path ("<tiny>", random-weight shapes) is not a folder: nothing is looked up."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "<tiny>").write_text("not a folder")
    assert eos_token_ids(_target("<tiny>", config_eos=(3,), tok_eos=None)) == (3,)
