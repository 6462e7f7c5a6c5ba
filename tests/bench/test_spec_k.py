"""bench.spec_k: the K table from timed runs and the choice of the default K."""

from types import SimpleNamespace

import pytest

from blockdraft.side_by_side import TimedRun
from blockdraft.bench.spec_k import best_row, k_table
from blockdraft.engine.request import SpecStats


def run(tokens, seconds, steps=0, accepted=0):
    out = SimpleNamespace(token_ids=tokens, num_output_tokens=len(tokens), spec=SpecStats(steps, steps, accepted))
    return TimedRun(out, [seconds], [2 * seconds])


def test_table_pools_prompts_and_flags_differing_answers():
    runs = {
        "plain": [run([1, 2, 3, 4], 4.0), run([5, 6], 2.0)],
        "K=1": [run([1, 2, 3, 4], 3.0, steps=3, accepted=1), run([5, 6], 1.0, steps=1, accepted=1)],
        "K=2": [run([1, 2, 3, 9], 2.0, steps=2, accepted=2), run([5, 6], 1.0, steps=1, accepted=1)],
    }
    rows = k_table(runs, [1, 2])
    assert rows[0]["acceptance_length"] == pytest.approx((2 + 4) / 4)
    assert rows[0]["speedup"] == pytest.approx(6 / 4) and rows[0]["cpu_speedup"] == pytest.approx(6 / 4)
    assert rows[0]["per_prompt_speedup"] == pytest.approx([4 / 3, 2.0])
    assert rows[0]["tokens_per_s"] == pytest.approx(6 / 4)
    assert rows[0]["identical"] and not rows[1]["identical"]
    assert best_row(rows)["k"] == 1  # K=2 is faster but changed an answer


def test_best_row_prefers_the_smaller_k_on_ties_and_refuses_without_identical_rows():
    rows = [{"k": 3, "speedup": 1.1, "cpu_speedup": 1.0, "identical": True},
            {"k": 1, "speedup": 1.1, "cpu_speedup": 1.2, "identical": True}]
    assert best_row(rows)["k"] == 1 and best_row(rows, "cpu_speedup")["k"] == 1
    rows[1]["cpu_speedup"] = 0.9
    assert best_row(rows, "cpu_speedup")["k"] == 3
    with pytest.raises(ValueError, match="metric must be"):
        best_row(rows, "tokens")
    with pytest.raises(ValueError, match="no K produced answers identical"):
        best_row([dict(rows[0], identical=False)])


def test_table_and_choice_over_draft_vocabulary_sizes():
    runs = {
        "plain": [run([1, 2], 2.0)],
        "K=2": [run([1, 2], 1.6, steps=1, accepted=1)],
        "K=2,V=64": [run([1, 2], 1.2, steps=1, accepted=1)],
    }
    rows = k_table(runs, [(2, 0), (2, 64)])
    assert [r["draft_vocab_size"] for r in rows] == [0, 64]
    assert rows[1]["speedup"] == pytest.approx(2.0 / 1.2)
    best = best_row(rows)
    assert (best["k"], best["draft_vocab_size"]) == (2, 64)


def test_draft_auto_measures_the_shipped_drafter_even_where_auto_would_skip_it(capsys):
    """spec_k measures a drafter, so `--draft auto` is the shipped one even where auto elsewhere
    would decode plainly (a speculative.json with draft_auto false; it crashed on the missing
    folder): the run gets as far as checking --ks against that drafter."""
    from blockdraft.bench.spec_k import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "smollm2-135m-instruct", "--draft", "auto", "--ks", "16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--ks" in err and "block_size - 1 = 15" in err
