"""`blockdraft demo` end to end on the tiny random model + a tiny DFlash drafter (CPU, seconds)."""

from __future__ import annotations

import json
import sys

import pytest

from blockdraft.cli import main
from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.tiny_model import word, write_tiny_drafter, write_tiny_model

PROMPTS = [" ".join(word(i) for i in (5, 17, 33, 8)), " ".join(word(i) for i in (60, 2, 71))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    model = write_tiny_model(root / "model")
    return model, write_tiny_drafter(root / "drafter", model)


def _demo(tiny, tmp_path, *extra):
    model, drafter = tiny
    out = tmp_path / "demo.json"
    code = main(["demo", *PROMPTS, "--model", str(model), "--draft", str(drafter), "--max-tokens", "12",
                 "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_demo_prints_answers_identical_to_plain_with_acceptance_and_speedup(tiny, tmp_path, capsys):
    code, report = _demo(tiny, tmp_path, "--repeats", "2")
    printed = capsys.readouterr().out
    assert code == 0
    plain = LLM(model=str(tiny[0])).generate([[{"role": "user", "content": p}] for p in PROMPTS],
                                             SamplingParams(max_tokens=12))
    assert [p["prompt"] for p in report["prompts"]] == PROMPTS
    for row, ref in zip(report["prompts"], plain):
        assert row["token_ids"] == ref.token_ids and row["text"] == ref.text
        assert row["identical_to_plain"] and row["deterministic"] and row["dflash_token_ids"] is None
        assert len(row["plain_seconds"]) == len(row["dflash_seconds"]) == 2
        assert row["num_drafted_tokens"] > 0 and row["acceptance_length"] >= 1.0
        assert row["acceptance_length"] == pytest.approx(
            (row["num_accepted_tokens"] + row["num_verify_steps"]) / row["num_verify_steps"])
        assert row["speedup"] > 0 and row["plain_tokens_per_s"] > 0 and row["dflash_tokens_per_s"] > 0
        assert f"[{report['prompts'].index(row) + 1}/2] {row['prompt']}" in printed
        assert row["text"].rstrip() in printed
    summary = report["summary"]
    assert summary["all_identical"] and summary["num_identical"] == 2
    assert summary["num_output_tokens"] == sum(len(o.token_ids) for o in plain)
    assert report["num_speculative_tokens"] == 7  # the tiny drafter's block_size 8 - 1
    assert "(K = 7 drafts per step)" in printed and report["draft_vocab_size"] == 0  # full vocabulary
    assert printed.count("identical to plain: yes") == 2
    # Two repeats: both answers come first, then one speed line per prompt, then the summary.
    speed = printed.index("speed, median of 2 timed runs per engine:")
    assert max(printed.index(row["text"].rstrip()) for row in report["prompts"]) < speed
    assert printed.index("  -> [1/2] plain ") > speed and printed.index("  -> [2/2] plain ") > speed
    assert "summary: identical to plain on 2/2 prompts" in printed and "speedup" in printed
    assert printed.index("summary:") > printed.index("  -> [2/2] plain ")


def _demo_terminal(tiny, tmp_path, capsys, monkeypatch, repeats: int) -> list[str]:
    """The demo's lines as a terminal shows them: stdout and stderr (progress) in one stream."""
    monkeypatch.setattr(sys, "stderr", sys.stdout)
    code, _ = _demo(tiny, tmp_path, "--repeats", str(repeats))
    assert code == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def _kinds(lines: list[str]) -> list[str]:
    """Each line's kind, in order: answer header, progress, speed header, speed line, summary."""
    kinds = []
    for line in lines:
        if line.startswith("[") and "/2] " in line:
            kinds.append("answer")
        elif line.startswith("  (prompt "):
            kinds.append("progress")
        elif line.startswith("  (warming up: "):
            kinds.append("warm-up")
        elif line.startswith("speed, median"):
            kinds.append("speed header")
        elif line.startswith("  -> [") and " plain " in line:
            kinds.append("speed")
        elif line.startswith("summary:"):
            kinds.append("summary")
    return kinds


def test_demo_with_repeats_prints_answers_then_speed_lines_then_summary(tiny, tmp_path, capsys, monkeypatch):
    """No progress line of a timed run lands between the speed lines (they come after all runs)."""
    kinds = _kinds(_demo_terminal(tiny, tmp_path, capsys, monkeypatch, repeats=3))
    first_speed = kinds.index("speed header")
    assert "progress" not in kinds[first_speed:] and "answer" not in kinds[first_speed:]
    assert kinds[first_speed:] == ["speed header", "speed", "speed", "summary"]
    assert kinds[:first_speed].count("answer") == 2 and kinds[:first_speed].count("progress") == 2 * 2 * 3


def test_demo_with_one_run_prints_each_speed_line_after_its_answer(tiny, tmp_path, capsys, monkeypatch):
    kinds = [k for k in _kinds(_demo_terminal(tiny, tmp_path, capsys, monkeypatch, repeats=1)) if k != "progress"]
    assert kinds == ["warm-up", "answer", "speed", "answer", "speed", "summary"]  # a line before the slow warm-up


def test_demo_shows_each_answer_before_the_later_timed_runs(tiny):
    """A user who stops a slow demo has seen every answer decoded so far."""
    from blockdraft.demo import run_demo
    from blockdraft.llm import load_target

    model, drafter = tiny
    events = []
    report = run_demo(
        load_target(str(model), "auto"), drafter, PROMPTS, SamplingParams(max_tokens=12), repeats=3,
        on_run=lambda label, i, r, s: events.append(("run", i, r)),
        on_answer=lambda i, res: events.append(("answer", i, res.text, res.identical_to_plain)),
        on_timed=lambda i, res: events.append(("timed", i, len(res.plain_seconds), len(res.dflash_seconds))),
    )
    answers = [e for e in events if e[0] == "answer"]
    assert [(i, text, same) for _, i, text, same in answers] == [(i, p.text, True) for i, p in enumerate(report.prompts)]
    for i in range(len(PROMPTS)):  # answer i right after both engines' first run of prompt i
        at = events.index(answers[i])
        assert events[at - 2:at] == [("run", i, 0)] * 2
        assert ("timed", i, 3, 3) in events and events.index(("timed", i, 3, 3)) == events.index(("run", i, 2)) + 2
    assert events[-1] == ("timed", len(PROMPTS) - 1, 3, 3)


def test_demo_reports_an_answer_that_differs_from_plain(tiny, tmp_path, capsys, monkeypatch):
    """Control: a verifier that accepts every draft changes the answers; the demo must say so."""
    import blockdraft.runner.model_runner as runner

    monkeypatch.setattr(runner, "verify_drafts", lambda target, drafts, num_drafts: num_drafts.clone())
    code, report = _demo(tiny, tmp_path)
    captured = capsys.readouterr()
    assert code == 1 and not report["summary"]["all_identical"]
    differing = [p for p in report["prompts"] if not p["identical_to_plain"]]
    assert differing and all(p["dflash_token_ids"] != p["token_ids"] for p in differing)
    assert "identical to plain: NO" in captured.out and "changed an answer" in captured.err


def test_demo_explicit_k_and_bad_flags(tiny, tmp_path, capsys):
    code, report = _demo(tiny, tmp_path, "--num-speculative-tokens", "2")
    assert code == 0 and report["num_speculative_tokens"] == 2 and report["summary"]["all_identical"]
    model, _ = tiny
    assert main(["demo", "w05x", "--model", str(model)]) == 2  # a folder model: no shipped drafter
    assert "no drafter ships for model" in capsys.readouterr().err
    assert main(["demo", "w05x", "--model", "nosuchmodel"]) == 2  # named as an unknown model, not a drafter
    assert "unknown model 'nosuchmodel'; catalog models:" in capsys.readouterr().err
    assert main(["demo", "w05x", "--model", str(tmp_path / "gone" / "m")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["demo", "w05x", "--model", str(model), "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    assert main(["demo", "w05x", "--model", str(model), "--draft", str(tiny[1]), "--temperature", "0.7"]) == 0


def test_demo_refuses_an_unwritable_json_path_before_decoding(tiny, tmp_path, capsys):
    model, drafter = tiny
    bad = tmp_path / "missing-folder" / "report.json"
    assert main(["demo", "w05x", "--model", str(model), "--draft", str(drafter), "--json", str(bad)]) == 2
    err = capsys.readouterr()
    assert "does not exist" in err.err and "missing-folder" in err.err
    assert "identical to plain" not in err.out  # nothing was decoded


def test_demo_refuses_a_json_path_that_is_a_folder_before_decoding(tiny, tmp_path, capsys):
    """--json naming a folder failed with IsADirectoryError after every prompt was decoded."""
    model, drafter = tiny
    assert main(["demo", "w05x", "--model", str(model), "--draft", str(drafter), "--json", str(tmp_path)]) == 2
    err = capsys.readouterr()
    assert f"--json {str(tmp_path)!r} is a folder" in err.err and len(err.err.strip().splitlines()) == 1
    assert "identical to plain" not in err.out  # nothing was decoded


def _result(speedup: float, acceptance_length: float | None):
    from blockdraft.demo import PromptResult

    return PromptResult("p", "t", [1] * 10, "length", True, None, True, 10, acceptance_length, [0.5], 4, 8, 2,
                        [1.0], [1.0 / speedup], [1.0], [1.0 / speedup], 10.0, 10.0 * speedup, speedup)


def test_speed_line_warns_when_the_speedup_exceeds_the_acceptance_length():
    """More speedup than acceptance length is impossible: the timing was disturbed by other load."""
    from blockdraft.demo import DemoReport, format_speed, format_summary

    assert "warning" not in format_speed(1, 1, _result(1.4, 1.5))
    assert "warning" not in format_speed(1, 1, _result(1.4, None))  # no drafts: nothing to compare
    line, warning = format_speed(1, 1, _result(3.0, 1.5)).splitlines()
    assert line.endswith("speedup 3.00x")
    assert warning == ("  warning: speedup 3.00x exceeds the acceptance length 1.50, which is impossible: the timing "
                       "looks disturbed by other load on the machine; re-run with --repeats 3 (or on a quiet machine)")
    report = DemoReport("m", "d", "bfloat16", 4, 96, 1, 0.0, None, 2, prompts=[_result(3.0, 1.5)])
    assert format_summary(report).splitlines()[1].startswith("warning: speedup 3.00x exceeds the acceptance length")
    calm = DemoReport("m", "d", "bfloat16", 4, 96, 1, 0.0, None, 2, prompts=[_result(1.2, 1.5)])
    assert "warning" not in format_summary(calm) and "note" not in format_summary(calm)
    # one disturbed prompt that the pooled figures hide (speedup 1.5, acceptance 1.5): a note names it
    mixed = DemoReport("m", "d", "bfloat16", 4, 96, 1, 0.0, None, 2, prompts=[_result(3.0, 1.5), _result(1.0, 1.5)])
    assert format_summary(mixed).splitlines()[1] == (
        "note: the summary includes the disturbed timing of prompt 1 (speedup above its acceptance length); "
        "rerun with --repeats 3 (or on a quiet machine)")


def test_demo_warns_after_each_prompt_whose_timing_was_disturbed(tiny, tmp_path, capsys, monkeypatch):
    """End to end with faked timing: plain runs made 1000x slower (as if other jobs took the cores)."""
    import blockdraft.demo
    from blockdraft.side_by_side import TimedRun

    real = blockdraft.demo.compare_engines

    def slow_plain(engines, *args, **kwargs):
        runs = real(engines, *args, **kwargs)
        runs["plain"] = [TimedRun(r.output, [t * 1000 for t in r.seconds], r.cpu_seconds, r.deterministic)
                         for r in runs["plain"]]
        return runs

    monkeypatch.setattr(blockdraft.demo, "compare_engines", slow_plain)
    _demo(tiny, tmp_path, "--repeats", "2")
    lines = capsys.readouterr().out.splitlines()
    speed = [i for i, line in enumerate(lines) if line.startswith("  -> [") and " plain " in line]
    assert len(speed) == 2
    for i in speed:
        assert lines[i + 1].startswith("  warning: speedup") and "--repeats 3" in lines[i + 1]
    summary = next(i for i, line in enumerate(lines) if line.startswith("summary:"))
    assert lines[summary + 1].startswith("warning: speedup")


def test_demo_header_names_the_draft_vocabulary():
    from blockdraft.demo import DemoReport, format_header

    report = DemoReport("m", "d", "bfloat16", 4, 96, 1, 0.0, None, 2, draft_vocab_size=32768)
    assert "(K = 4 drafts per step, draft vocabulary 32768 ids)" in format_header(report)


def test_demo_summary_warns_when_plain_speed_swings():
    from blockdraft.demo import DemoReport, PromptResult, format_summary

    def row(plain_seconds):
        return PromptResult("p", "t", [1] * 10, "length", True, None, True, 10, 1.5, [0.5], 4, 8, 2,
                            plain_seconds, [0.4] * len(plain_seconds), plain_seconds, [0.4] * len(plain_seconds),
                            10.0, 14.0, 1.4)  # each prompt's speedup below its acceptance length 1.5

    calm = DemoReport("m", "d", "bfloat16", 4, 96, 2, 0.0, None, 2, prompts=[row([0.5, 0.55]), row([0.6, 0.5])])
    assert "note:" not in format_summary(calm)
    busy = DemoReport("m", "d", "bfloat16", 4, 96, 2, 0.0, None, 2, prompts=[row([0.5, 0.5]), row([5.0, 0.5])])
    note = format_summary(busy).splitlines()[-1]
    assert note.startswith("note: plain decoding ran at 2.0 to 20.0 tok/s across runs (10.0x apart)")


def test_demo_summary_names_runs_that_got_far_less_cpu_time():
    """A DFlash run slowed by other processes (plain speed steady, so the swing check stays quiet):
    its CPU time per wall second falls far below the other runs', and the summary names it."""
    from blockdraft.demo import DemoReport, PromptResult, format_summary

    def row(dflash_wall, dflash_cpu):
        return PromptResult("p", "t", [1] * 10, "length", True, None, True, 10, 2.0, [0.5], 4, 8, 2,
                            [1.0], [dflash_wall], [2.0], [dflash_cpu], 10.0, 10.0 / dflash_wall, 1.0 / dflash_wall)

    calm = DemoReport("m", "d", "bfloat16", 4, 96, 1, 0.0, None, 2, prompts=[row(0.6, 1.19), row(0.7, 1.4)])
    assert "note:" not in format_summary(calm)
    starved = DemoReport("m", "d", "bfloat16", 4, 96, 1, 0.0, None, 2, prompts=[row(0.6, 1.19), row(5.0, 2.0)])
    assert format_summary(starved).splitlines()[-1] == (
        "note: prompt 2 DFlash got as little as 20% of the CPU time per second of the best run: other processes "
        "took the cores, so those timings and the speedup are unreliable; rerun on a quiet machine, with "
        "--repeats 3 (or --threads 1 on a shared machine)")
