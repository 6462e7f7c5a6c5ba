"""Flags are taken by their whole name only: argparse's prefix matching (allow_abbrev) would read
`serve --max-tokens 32` as `--max-tokens-limit 32` without a word."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _parsers(parser: argparse.ArgumentParser):
    """`parser` and every subcommand parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_a_prefix_of_a_serve_flag_is_an_unknown_flag(capsys):
    from blockdraft.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "/nonexistent-model", "--max-tokens", "32"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-tokens 32" in err, err


def test_every_blockdraft_command_parser_refuses_abbreviations():
    from blockdraft.cli import _parser

    parsers = list(_parsers(_parser()))
    assert len(parsers) > 6  # the command and its subcommands (generate, serve, bench, ...)
    assert [p.prog for p in parsers if p.allow_abbrev] == []
    args = _parser().parse_args(["generate", "hi", "--max-tokens", "3"])  # whole names still work
    assert args.max_tokens == 3


def test_every_module_entry_point_parser_refuses_abbreviations():
    """`python -m blockdraft....` and scripts/: each ArgumentParser(...) passes allow_abbrev=False,
    and so does each add_parser(...) of a file that builds its own parser (the `blockdraft`
    command's subparsers inherit it from cli._Parser)."""
    missing = []
    for path in sorted([*ROOT.glob("blockdraft/**/*.py"), *ROOT.glob("scripts/*.py")]):
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and getattr(n.func, "attr", getattr(n.func, "id", None)) in ("ArgumentParser", "add_parser")]
        if not any(getattr(n.func, "attr", None) == "ArgumentParser" for n in calls):
            continue  # subparsers of a parser built elsewhere (cli._Parser)
        for n in calls:
            if not any(k.arg == "allow_abbrev" and getattr(k.value, "value", None) is False for k in n.keywords):
                missing.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert missing == []


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "hi", "--max-tok", "8"],
         "blockdraft generate: error: unrecognized arguments: --max-tok 8 (flags are not abbreviated; did you mean "
         "--max-tokens?)"),
        (["generate", "hi", "--max-tok=8"], "unrecognized arguments: --max-tok=8 (flags are not abbreviated; did you "
                                            "mean --max-tokens?)"),
        (["generate", "hi", "--max-tokes", "8"], "unrecognized arguments: --max-tokes 8 (did you mean --max-tokens or --min-tokens?)"),
        (["generate", "hi", "--max", "8"], "(flags are not abbreviated; did you mean --max-model-len or --max-tokens?)"),
        (["generate", "hi", "--sed", "3", "--max-tok", "8"],
         "(flags are not abbreviated; did you mean --seed (for --sed), --max-tokens (for --max-tok)?)"),
        (["generate", "hi", "--zzz"], "blockdraft generate: error: unrecognized arguments: --zzz\n"),
        (["serve", "--max-tokens", "32"], "blockdraft serve: error: unrecognized arguments: --max-tokens 32 (flags are "
                                          "not abbreviated; did you mean --max-tokens-limit?)"),
    ],
)
def test_an_unknown_flag_is_reported_by_its_subcommand_with_the_closest_flags(capsys, argv, expected):
    """The subcommand's usage and prog (not the top-level usage), and the flags it may have meant."""
    from blockdraft.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert err.startswith(f"usage: blockdraft {argv[0]} "), err  # the subcommand's usage line
