"""train-drafter --device defaults to auto like the other commands (CUDA when torch sees a GPU, else
the CPU); an explicit cpu still wins."""

from __future__ import annotations

import argparse

import pytest

from blockdraft.cli import _parser, main
from tests.server.tiny_model import write_tiny_model


class Reached(Exception):
    """Raised by the stubbed drafter builder (the first step given the device), with that device."""


@pytest.fixture
def first_device(monkeypatch):
    """new_drafter raises Reached(device): the device train-drafter resolved, before any weights load."""

    def stop(*args, device, **kwargs):
        raise Reached(device)

    monkeypatch.setattr("blockdraft.training.build.new_drafter", stop)
    monkeypatch.setattr("blockdraft.model_loader.load_target", lambda *a, **k: pytest.fail("weights loaded"))


def test_default_is_auto_like_the_other_commands():
    assert _parser().parse_args(["train-drafter"]).device == "auto"
    assert _parser().parse_args(["train-drafter", "--device", "cpu"]).device == "cpu"
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["train-drafter"].format_help().split())
    assert "(default auto: cuda when torch sees a GPU, else cpu)" in text
    assert "cpu (default)" not in text


@pytest.mark.parametrize("cuda, flags, expected", [
    (False, [], "cpu"),  # CI: no CUDA, auto is the CPU
    (True, [], "cuda"),
    (True, ["--device", "cpu"], "cpu"),
])
def test_device_reaches_training(tmp_path, monkeypatch, first_device, cuda, flags, expected):
    """No flag: auto, CUDA when torch sees a GPU (faked here), else cpu; --device cpu: cpu."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    model = write_tiny_model(tmp_path / "model")
    with pytest.raises(Reached) as e:
        main(["train-drafter", "--tiny", "--target", str(model), "--out", str(tmp_path / "out"), *flags])
    assert e.value.args == (expected,)
