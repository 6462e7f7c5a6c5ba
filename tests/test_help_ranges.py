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


def test_every_option_with_a_default_names_it():
    # e.g. serve --max-num-seqs (64) and train-drafter --ckpt-every (0) said nothing of theirs
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = {name: [a.option_strings[0] for a in command._actions
                     if a.option_strings and a.default is not None and a.default is not False
                     and a.default != argparse.SUPPRESS and "default" not in (a.help or "")]
              for name, command in sub.choices.items()}
    assert silent == {name: [] for name in sub.choices}
    serve = {a.option_strings[0]: a for a in sub.choices["serve"]._actions if a.option_strings}
    for flag, default in [("--max-tokens-limit", 4096), ("--max-n", 16), ("--max-pending", 1024),
                          ("--kv-block-size", 16), ("--max-num-seqs", 64)]:
        action = serve[flag]
        assert (action.help % vars(action)).endswith(f"(default {default})"), flag
    # a device-dependent default: None in argparse, both values in the help
    assert serve["--max-num-batched-tokens"].default is None
    assert "default: 512 on CPU, 8192 on CUDA" in serve["--max-num-batched-tokens"].help
    assert "steps between checkpoints (default 0: only at the end)" in _help("train-drafter")


def test_cache_dir_help_is_the_same_in_every_command():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {name: next(a.help for a in command._actions if "--cache-dir" in a.option_strings)
             for name, command in sub.choices.items()}
    default = "(default $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft)"
    assert helps == {name: ("model and data cache " if name in ("train-drafter", "eval-drafter", "bench")
                            else "model cache ") + default for name in sub.choices}


def test_version(capsys):
    import re
    from pathlib import Path

    import pytest

    import blockdraft
    from blockdraft.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"blockdraft {blockdraft.__version__}\n"
    # the package metadata's version (pyproject.toml) and blockdraft.__version__ are one
    version = re.search(r'^version = "([^"]+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text(), re.M)[1]
    assert blockdraft.__version__ == version


def test_val_fraction_help_names_the_cap_and_the_default_cadence():
    from blockdraft.training.dataset import MAX_VAL_SEQUENCES
    from blockdraft.training.pipeline import VAL_EVERY_LOGS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.option_strings[0]: a.help for a in sub.choices["train-drafter"]._actions if a.option_strings}
    assert f"at least 1 and at most {MAX_VAL_SEQUENCES} answers" in helps["--val-fraction"]
    assert f"(default {VAL_EVERY_LOGS} x --log-every)" in helps["--val-every"]


def test_per_position_fields_say_which_are_rates_and_which_counts():
    """generate --json's acceptance_per_position and eval-drafter's per_position are rates,
    accepted_per_position / drafted_per_position counts: the help says so (the names stay)."""
    assert ("entry i of acceptance_per_position is the acceptance rate of draft position i + 1 (accepted / drafted, "
            "null where nothing was drafted) and entry i of drafted_per_position the count of verify steps that "
            "drafted it") in _help("generate")
    assert ("drafted_per_position and accepted_per_position are counts (verify steps that drafted it / accepted it), "
            "per_position the rates, accepted / drafted") in _help("eval-drafter")
