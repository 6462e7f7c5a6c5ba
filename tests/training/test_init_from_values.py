"""--init-from takes a drafter folder or 'shipped', and its error says exactly that: not the
message of --draft, which also takes 'auto' (no weights, no target needed here)."""

from __future__ import annotations

import argparse

import pytest

from blockdraft.training.pipeline import apply_init_shape


def _args(init_from: str) -> argparse.Namespace:
    return argparse.Namespace(init_from=init_from, target="smollm2-135m-instruct", cache_dir=None)


@pytest.mark.parametrize("value", ["auto", "/nonexistent/drafter", "file"])
def test_a_value_that_is_not_a_folder_lists_what_init_from_takes(value, tmp_path):
    if value == "file":
        value = str(tmp_path / "model.safetensors")
        (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as e:
        apply_init_shape(_args(value), {})
    message = str(e.value)
    what = "is a file, not a folder" if value.endswith(".safetensors") else "does not exist"
    assert message.startswith(f"drafter folder {value!r} {what}; --init-from takes a DFlash checkpoint folder "
                              "(config.json + *.safetensors or model.int8) or 'shipped'")
    offered = message.split("; ", 1)[1].replace("--init-from has no 'auto'", "")
    assert "'auto'" not in offered  # never offered as a value
    assert ("--init-from has no 'auto'" in message) == (value == "auto")


def test_init_from_help_offers_the_same_values():
    from blockdraft.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["train-drafter"]._actions if "--init-from" in a.option_strings)
    assert "'shipped'" in action.help and "'auto'" not in action.help and "model.int8" in action.help
