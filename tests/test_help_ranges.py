"""--help names the allowed range of the draft vocabulary flags and what --data does with a
missing folder (a newcomer reads these before the error messages)."""

from __future__ import annotations

import argparse

from blockdraft.cli import _parser as build_parser


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[command].format_help().split())  # one line: no wrapping breaks


def test_draft_vocab_size_help_names_the_minimum():
    for command in ("generate", "serve", "demo", "eval-drafter"):
        assert "0 = the full vocabulary, else N >= 256" in _help(command), command


def test_train_vocab_size_help_names_the_range():
    assert "else 256 <= N <= V" in _help("train-drafter")


def test_data_help_says_a_missing_folder_is_generated_into():
    text = _help("train-drafter")
    assert "reused when it holds data-*.safetensors, else generated into it" in text
    assert "instead of generating one" not in text


def test_train_drafter_help_gives_every_preset_value():
    from blockdraft.training.pipeline import DEFAULTS, TINY

    text = _help("train-drafter")
    assert "(preset value unless given)" not in text
    assert f"(default {DEFAULTS['num_prompts']}; --tiny: {TINY['num_prompts']})" in text
    assert f"(default {DEFAULTS['steps']}; --tiny: {TINY['steps']})" in text
    assert f"(default: the target's) (--tiny: {TINY['intermediate_size']})" in text


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = {name: [a.option_strings[0] for a in command._actions if a.option_strings and not a.help]
            for name, command in sub.choices.items()}
    assert bare == {name: [] for name in sub.choices}
    assert "--dtype" in _help("eval-drafter") and "model and data cache" in _help("eval-drafter")
