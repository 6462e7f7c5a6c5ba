"""LLM: K without a drafter is refused; draft="auto" / "shipped" follow the LOADED target."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM
from blockdraft.model_loader import catalog_name as _catalog_name
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


def _fetched_folder(root, name, sha):
    """A folder as `blockdraft fetch` leaves it: the marker naming the catalog entry and GGUF sha."""
    import json

    from blockdraft.weights.fetch import MARKER

    folder = root / "models" / name
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps({"name": name, "sha256": sha}))
    return str(folder)


def test_catalog_name_of_a_fetched_folder_only(tmp_path):
    from blockdraft.weights.catalog import CATALOG

    name = "qwen2.5-coder-0.5b-instruct"
    assert _catalog_name(_fetched_folder(tmp_path / "a", name, CATALOG[name].sha256)) == name
    # named like a catalog model but not fetch's conversion of it (no marker, other GGUF): no mapping
    assert _catalog_name(str(tmp_path / "models" / name)) == str(tmp_path / "models" / name)
    other = _fetched_folder(tmp_path / "b", name, "0" * 64)
    assert _catalog_name(other) == other
    assert _catalog_name("/x/models/mine") == "/x/models/mine"


def test_cli_draft_resolution_maps_the_path_fetch_prints(tmp_path):
    """`blockdraft generate --model <the path fetch printed>` keeps the shipped drafter (auto and
    shipped), as `--model <name>` does."""
    from blockdraft.drafters import resolve_draft, shipped_names
    from blockdraft.weights.catalog import CATALOG

    name = "qwen2.5-coder-0.5b-instruct"
    assert name in shipped_names()
    folder = _fetched_folder(tmp_path, name, CATALOG[name].sha256)
    want = resolve_draft("auto", name, cache_dir=tmp_path / "cache")
    assert want is not None
    assert resolve_draft("auto", folder, cache_dir=tmp_path / "cache") == want
    assert resolve_draft("shipped", folder, cache_dir=tmp_path / "cache") == want


@pytest.mark.parametrize("draft", [["--draft", "shipped"], ["--draft", "auto"], []])
def test_eval_drafter_maps_the_path_fetch_prints_too(tmp_path, monkeypatch, capsys, draft):
    """`eval-drafter --target <the path fetch printed>` evaluates the shipped drafter, as generate
    and train-drafter's --init-from shipped do (a fresh-user trial found it refused)."""
    from blockdraft.cli import main
    from blockdraft.drafters import resolve_draft
    from blockdraft.training import evaluate
    from blockdraft.weights.catalog import CATALOG

    name = "smollm2-135m-instruct"
    folder = _fetched_folder(tmp_path, name, CATALOG[name].sha256)
    seen = {}

    def fake_evaluate(target, drafter, *args, **kwargs):
        seen.update(target=target, drafter=drafter)
        raise SystemExit(0)  # resolution is what this test is about: stop before any decoding

    monkeypatch.setattr("blockdraft.preflight.read_target_config", lambda *a, **k: None)
    monkeypatch.setattr(evaluate, "evaluate_drafter", fake_evaluate)
    with pytest.raises(SystemExit):
        main(["eval-drafter", "--target", folder, *draft, "--cache-dir", str(tmp_path / "cache")])
    assert seen == {"target": folder, "drafter": resolve_draft("shipped", name, cache_dir=tmp_path / "cache")}
