"""bench.structured: the per-task table from timed runs, the constraint check, flag errors; and one
real run of a task on the shipped Qwen drafter (slow)."""

import json
from types import SimpleNamespace

import pytest

from blockdraft.bench.structured import DFLASH, PLAIN, follows, main, passes, task_rows
from blockdraft.engine.request import SpecStats
from blockdraft.side_by_side import TimedRun


def run(tokens, seconds, text="", steps=0, accepted=0, finish="stop"):
    out = SimpleNamespace(token_ids=tokens, num_output_tokens=len(tokens), spec=SpecStats(steps, steps, accepted),
                          text=text, finish_reason=finish)
    return TimedRun(out, [seconds], [seconds])


def test_rows_give_speedup_acceptance_identity_and_constraint_per_task():
    runs = {"person": {PLAIN: run([1, 2, 3], 3.0, '{"name": "a", "age": 1, "languages": []}'),
                       DFLASH: run([1, 2, 3], 1.0, steps=1, accepted=2)},
            "date": {PLAIN: run([4], 1.0, "2008-12-03", finish="length"), DFLASH: run([5], 1.0)}}
    rows = task_rows(runs, {"person": {PLAIN: 0.003, DFLASH: 0.002}, "date": {PLAIN: 0.0, DFLASH: 0.0}},
                     {"person": {PLAIN: 3, DFLASH: 1}, "date": {PLAIN: 1, DFLASH: 1}})
    person, date = rows
    assert person["speedup"] == pytest.approx(3.0) and person["acceptance_length"] == pytest.approx(3.0)
    assert person["identical"] and person["follows"]
    assert person["grammar_ms_per_step"] == pytest.approx({PLAIN: 1.0, DFLASH: 2.0})
    assert not date["identical"] and not date["follows"]  # another answer; cut by length


@pytest.mark.parametrize("fields, text, ok", [
    ({"regex": r"\d{4}"}, "2008", True), ({"regex": r"\d{4}"}, "2008 ", False),
    ({"choice": ["a", "b"]}, "b", True), ({"choice": ["a", "b"]}, "c", False),
    ({"json": {"required": ["x"]}}, '{"x": 1}', True), ({"json": {"required": ["x"]}}, '{"y": 1}', False),
    ({"json_object": True}, "{}", True), ({"json_object": True}, "[", False),
])
def test_follows(fields, text, ok):
    assert follows(fields, text) is ok


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "person,nope"], "unknown task(s) ['nope']"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_flags_are_usage_errors_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_one_task_on_the_shipped_drafter_writes_the_table(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["--tasks", "http", "--repeats", "1", "--max-tokens", "64", "--device", "cpu",
                 "--draft-vocab-size", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["draft_vocab_size"] == 0
    (row,) = result["tasks"]
    assert row["identical"] and row["follows"] and row["acceptance_length"] > 1
    assert result["pooled"]["tokens"] == row["tokens"] and "| http |" in capsys.readouterr().out


def test_a_divergence_is_judged_at_its_first_token_and_a_near_tie_passes(monkeypatch):
    """judge_divergences reads the two divergent tokens' gap on the plain engine (and on a float32
    one: here the same engine, so it picks plain's token by construction); the table tags the row,
    and `passes` accepts a near-tie only."""
    from blockdraft.bench import near_ties
    from blockdraft.bench.structured import _identical_tag, judge_divergences
    from blockdraft.sampling_params import SamplingParams
    from tests.conftest import make_llm, random_prompts, tiny_target

    llm = make_llm(tiny_target("qwen3", seed=11))
    (prompt,) = random_prompts(1, seed=4)
    ref = list(llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids)
    top = llm.generate([prompt + ref[:2]], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=3))[0].logprobs[0]["top"]
    cand = ref[:2] + [top[2][0]]  # the third-ranked token: allowed by a grammar, not the top two
    runs = {"todo": {PLAIN: run(ref, 1.0), DFLASH: run(cand, 1.0, '{"tasks": []}', steps=1, accepted=2)}}
    for r in runs["todo"].values():
        r.output.prompt_token_ids = prompt
    (row,) = task_rows(runs, {"todo": {PLAIN: 0.0, DFLASH: 0.0}}, {"todo": {PLAIN: 1, DFLASH: 1}})
    assert row["divergence"] is None and _identical_tag(row) == "False"
    judge_divergences([row], runs, llm, llm_fp32=llm)
    d = row["divergence"]
    assert (d["index"], d["reference_token"], d["candidate_token"]) == (2, ref[2], top[2][0])
    assert d["pair_gap"] == pytest.approx(top[0][1] - top[2][1], abs=1e-4) and d["fp32_picks"] == "reference"
    assert not d["near_tie"] and _identical_tag(row).startswith("False (gap ")
    assert _identical_tag(row).endswith("fp32 = plain)") and not passes(row)
    monkeypatch.setattr(near_ties, "NEAR_TIE_GAP", d["pair_gap"] + 1e-3)
    judge_divergences([row], runs, llm)
    assert row["divergence"]["near_tie"] and _identical_tag(row).startswith("False (tie, gap ")
    assert passes(row)  # a near-tie, and DFlash's (fake) answer follows the schema
    row["dflash_follows"] = False
    assert not passes(row)


@pytest.mark.parametrize("deterministic, identical, near_tie, dflash_follows, ok", [
    (True, True, None, True, True),
    (True, False, True, True, True),  # a near-tie, the DFlash answer still valid
    (True, False, True, None, True),  # a near-tie, both cut by --max-tokens: cannot be judged, not failed
    (True, False, True, False, False),  # a "tie" to a token the grammar refuses
    (True, False, False, True, False),  # not a near-tie
    (False, False, True, True, False),  # answers changed from run to run
    (False, False, None, True, False),
])
def test_passes_only_stable_answers_equal_or_diverging_at_a_valid_near_tie(deterministic, identical, near_tie,
                                                                          dflash_follows, ok):
    row = {"deterministic": deterministic, "identical": identical, "dflash_follows": dflash_follows,
           "divergence": None if near_tie is None else {"near_tie": near_tie}}
    assert passes(row) is ok
