"""bench.token_mask runs on the CPU and writes one row per case (a smoke test: no timings are checked)."""

import json

import pytest

from blockdraft.bench.token_mask import main


def test_runs_and_writes_a_row_per_case(tmp_path, capsys):
    out = tmp_path / "mask.json"
    assert main(["-k", "0", "3", "--words", "0", "5", "--allowed", "none", "40", "--vocab", "100", "--steps", "4",
                 "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["k"], r["allowed"], r["words"]) for r in rows] == [
        (k, a, w) for k in (0, 3) for a in (None, 40) for w in (0, 5)]
    for r in rows:
        assert r["fill_us"] > 0 and len(r["fill_us_runs"]) == 2 and r["vocab"] == 100
        assert r["bans_per_row"] >= 0 and (r["words"] or r["bans_per_row"] == 0)
    assert "fill us" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["-k", "3", "-1"], "-k values must be >= 0, got -1"),
    (["--words", "-2"], "--words values must be >= 0, got -2"),
    (["--allowed", "0"], "--allowed sizes must lie in [1, --vocab 151936] (or 'none'), got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--out", "/nonexistent/x.json"], "/nonexistent"),
])
def test_bad_flags_are_refused_naming_the_value_before_running(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
