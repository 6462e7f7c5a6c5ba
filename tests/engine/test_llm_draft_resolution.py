"""LLM: K without a drafter is refused; draft="auto" / "shipped" follow the LOADED target."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM, _catalog_name
from tests.server.tiny_model import write_tiny_model


def test_k_without_a_drafter_is_refused(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 needs a drafter"):
        LLM(model=str(model), num_speculative_tokens=3)


def test_auto_and_shipped_follow_the_loaded_target(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    plain = LLM(model=str(model))
    # a target that is no catalog model: auto decodes plainly (not the default model's drafter)
    assert LLM(target=plain.target, draft="auto").speculator is None
    with pytest.raises(ValueError, match="no drafter ships for model"):
        LLM(target=plain.target, draft="shipped")


def test_catalog_name_of_a_cached_folder():
    assert _catalog_name("/x/models/qwen2.5-coder-0.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert _catalog_name("/x/models/mine") == "/x/models/mine"
