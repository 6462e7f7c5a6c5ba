"""`python -m blockdraft.bench.train_throughput` on the CPU with the tiny shape: table, JSON, bad flags."""

import json

import pytest

from blockdraft.bench import train_throughput


def test_tiny_cpu_run_prints_a_row_per_cell_and_writes_json(tmp_path, capsys):
    out = tmp_path / "tt.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--batch-sizes", "2,3",
            "--num-anchors", "4", "--num-sequences", "6", "--train-vocab-size", "256", "--prompt-len-max", "32",
            "--response-len-min", "8", "--response-len-max", "32", "--work", str(tmp_path / "w"), "--out", str(out)]
    assert train_throughput.main(argv) == 0
    result = json.loads(out.read_text())
    cells = [(r["features"], r["batch_size"]) for r in result["rows"]]
    assert cells == [("cached", 2), ("cached", 3), ("target", 2), ("target", 3)]
    assert all(r["ms_per_step"] > 0 for r in result["rows"])
    assert "| cached | 3 | 4 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--features", "cached,disk"], "'disk' is not one of cached, target"),
    (["--response-len-max", "10"], "--response-len-min 50 is larger than --response-len-max 10"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_throughput.main(["--shape", "tiny", "--device", "cpu"] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_train_vocab_larger_than_the_shape_is_an_error(tmp_path, capsys):
    argv = ["--shape", "tiny", "--device", "cpu", "--train-vocab-size", "100000", "--work", str(tmp_path)]
    assert train_throughput.main(argv) == 2
    assert "--train-vocab-size 100000 exceeds the tiny vocabulary (512)" in capsys.readouterr().err
