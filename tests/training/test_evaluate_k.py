"""eval-drafter measures acceptance over the drafter's whole block by default (block_size - 1
drafts, as acceptance lengths are reported), not the speed-tuned K of speculative.json."""

from __future__ import annotations

import json

import pytest

from blockdraft.training import evaluate
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_k")
    model = write_tiny_model(root / "model")
    drafter = write_tiny_drafter(root / "drafter", model)  # block_size 8
    (drafter / "speculative.json").write_text(json.dumps({"num_speculative_tokens": 1}))
    return model, drafter


@pytest.fixture(autouse=True)
def fixed_prompts(monkeypatch):
    monkeypatch.setattr("blockdraft.training.corpora.eval_prompts", lambda dataset, cache_dir=None: ["hello", "hi there"])


def test_default_k_is_the_whole_block(tiny):
    model, drafter = tiny
    r = evaluate.evaluate_drafter(str(model), str(drafter), num_prompts=2, max_tokens=6, compare_plain=True)
    # positions past 1 were drafted and accepted: K = 1 from speculative.json would give at most one
    assert r.num_speculative_tokens == 7 and 1 < len(r.accepted_per_position) <= 7
    assert r.identical_to_plain


def test_explicit_k_wins(tiny):
    model, drafter = tiny
    r = evaluate.evaluate_drafter(str(model), str(drafter), num_prompts=2, max_tokens=6, num_speculative_tokens=2)
    assert r.num_speculative_tokens == 2 and len(r.accepted_per_position) <= 2


def test_per_position_lists_have_k_entries_even_when_max_tokens_cuts_the_blocks(tiny):
    """A trial saw 14 entries at K = 15 with --max-tokens 16: every block was cut short of K drafts,
    so no step drafted the last positions. They are there, at 0 accepted and 0 drafted, without a
    rate (null); the drafted positions' rates divide by the steps that drafted them, not by all."""
    model, drafter = tiny
    r = evaluate.evaluate_drafter(str(model), str(drafter), num_prompts=2, max_tokens=3)
    assert r.num_speculative_tokens == 7
    assert len(r.accepted_per_position) == len(r.drafted_per_position) == len(r.per_position) == 7
    assert r.accepted_per_position[-1] == 0 and sum(r.accepted_per_position) == r.num_accepted
    assert r.drafted_per_position[-1] == 0 and r.per_position[-1] is None
    assert 0 < r.drafted_per_position[0] == r.num_steps  # every verify step drafted position 1
    assert r.per_position == [a / d if d else None for a, d in zip(r.accepted_per_position, r.drafted_per_position)]
    assert json.loads(json.dumps(r.to_dict(), allow_nan=False))["per_position"][-1] is None


def test_summary_line_reads_the_result(tiny):
    model, drafter = tiny
    r = evaluate.evaluate_drafter(str(model), str(drafter), num_prompts=2, max_tokens=6, compare_plain=True)
    line = evaluate.summary_line(r)
    assert f"acceptance length {r.acceptance_length:.2f} (K=7, draft vocabulary full" in line
    assert "identical to plain: yes" in line and "speedup" in line


def test_cli_runs_on_the_device_asked_for(tiny, capsys):
    """eval-drafter --device reaches the engines; the JSON records where they ran."""
    from blockdraft.cli import main
    from blockdraft.preflight import resolve_device

    model, drafter = tiny
    base = ["eval-drafter", "--target", str(model), "--draft", str(drafter), "--num-prompts", "2", "--max-tokens", "4"]
    assert main([*base, "--device", "cpu", "--compare-plain"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["identical_to_plain"]
    assert main(base) == 0  # default: auto, as generate
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == resolve_device("auto") and out["dtype"] == "float32"  # the default dtype, recorded
    # --model as generate spells it; --dtype as run is recorded (auto: the checkpoint's, here float32)
    assert main(["eval-drafter", "--model", str(model), *base[3:], "--dtype", "bfloat16", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert main([*base, "--dtype", "auto", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert main([*base, "--dtype", "float16", "--device", "cpu"]) == 0  # as generate takes it
    assert json.loads(capsys.readouterr().out)["dtype"] == "float16"


def test_no_verify_step_gives_null_not_nan(tiny, capsys):
    """--max-tokens 1: every answer ends at its first token, no verify step: the JSON on stdout
    stays valid JSON (acceptance_length null, not NaN) and the summary says n/a."""
    from blockdraft.cli import main

    model, drafter = tiny
    argv = ["eval-drafter", "--target", str(model), "--draft", str(drafter), "--num-prompts", "2", "--max-tokens", "1",
            "--device", "cpu"]
    assert main(argv) == 0
    captured = capsys.readouterr()

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    out = json.loads(captured.out, parse_constant=refuse)
    assert out["num_steps"] == 0 and out["acceptance_length"] is None
    assert out["per_position"] == [None] * 7 and out["drafted_per_position"] == [0] * 7  # one entry per K, as the counts
    assert "acceptance length n/a (K=7" in captured.err


def test_json_names_the_drafter_folder_evaluated_for_shipped_too(tiny, capsys, monkeypatch):
    """--draft shipped (and the default) report the folder evaluated, as a path does."""
    from blockdraft.cli import main

    model, drafter = tiny
    monkeypatch.setattr("blockdraft.drafters.shipped_drafter", lambda name, cache_dir=None: drafter)
    base = ["eval-drafter", "--target", str(model), "--num-prompts", "1", "--max-tokens", "2", "--device", "cpu"]
    for extra in (["--draft", "shipped"], []):
        assert main([*base, *extra]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["draft"] == str(drafter)
        assert "prompt, drafter shipped)" in captured.err  # the summary line names what was evaluated
    assert main([*base, "--draft", str(drafter)]) == 0
    assert f"prompt, drafter {drafter})" in capsys.readouterr().err


def test_help_says_what_eval_drafter_measures_on_which_prompts_and_writes():
    import argparse

    from blockdraft.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["eval-drafter"].format_help().split())
    assert "Measure a DFlash drafter with the target: decode the first --num-prompts HumanEval or MT-bench prompts" in text
    assert "acceptance length (tokens committed per verify step)" in text
    assert "Writes every figure as one JSON object on stdout and a one-line summary naming the drafter on stderr" in text


def test_a_slower_whole_block_run_points_to_the_k_decoding_uses(tiny):
    _, drafter = tiny  # speculative.json: K = 1
    slow = evaluate.EvalResult("humaneval", 0.0, 2, 6, num_steps=4, num_accepted=4, num_output_tokens=12, seconds=2.0,
                               plain_seconds=1.0, identical_to_plain=True, num_speculative_tokens=7)
    hint = evaluate.speed_hint(slow, drafter)
    assert hint.startswith("note: K=7 (the whole block) measures acceptance; generate / demo / serve decode with K=1 "
                           "on cpu for this drafter") and "--num-speculative-tokens 1 to time that; " in hint
    assert hint.endswith("this run decoded its 2 prompts together (a batch), generate one request at a time: "
                         "--num-prompts 1 times that")
    one = evaluate.speed_hint(evaluate.EvalResult(**{**slow.__dict__, "num_prompts": 1}), drafter)
    assert one.endswith("--num-speculative-tokens 1 to time that")  # one prompt: no batch to point out
    chosen = evaluate.speed_hint(slow, drafter, whole_block=False)  # --num-speculative-tokens 7 given: not "whole"
    assert chosen.startswith("note: this run timed K=7; generate / demo / serve decode with K=1 on cpu"), chosen
    assert evaluate.speed_hint(evaluate.EvalResult(**{**slow.__dict__, "seconds": 0.5}), drafter) is None  # faster
    assert evaluate.speed_hint(evaluate.EvalResult(**{**slow.__dict__, "num_speculative_tokens": 1}), drafter) is None
    assert evaluate.speed_hint(evaluate.EvalResult(**{**slow.__dict__, "identical_to_plain": None}), drafter) is None


def test_cli_json_flag_writes_what_stdout_gets(tiny, tmp_path, capsys):
    """--json PATH: the same document as stdout (which still gets it); a missing folder or an empty
    value is refused before any decoding, naming the path."""
    from blockdraft.cli import main

    model, drafter = tiny
    base = ["eval-drafter", "--target", str(model), "--draft", str(drafter), "--num-prompts", "2", "--max-tokens", "4",
            "--device", "cpu"]
    path = tmp_path / "eval.json"
    assert main([*base, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert json.loads(path.read_text()) == json.loads(out) and json.loads(out)["num_speculative_tokens"] == 7
    missing = tmp_path / "no-such-folder" / "eval.json"
    for value, message in [(str(missing), f"error: --json '{missing}': folder '{missing.parent}' does not exist\n"),
                           ("", "error: --json '' is empty: give the file to write, e.g. 'eval.json', or leave --json out\n")]:
        assert main([*base, "--json", value]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == message, err
    png = tmp_path / "same.png"  # the plot would overwrite the JSON: refused, nothing decoded or written
    assert main([*base, "--json", str(png), "--plot", str(png)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not png.exists() and err.startswith(f"error: --json '{png}' and --plot '{png}' are the same file"), err
