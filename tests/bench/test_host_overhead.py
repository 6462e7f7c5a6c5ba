"""bench.host_overhead runs end to end on the CPU and writes one row per case."""

import json

import pytest

from blockdraft.bench.host_overhead import HOST_SHAPE, main


def test_runs_and_writes_rows(tmp_path):
    out = tmp_path / "host.json"
    assert main(["--batch", "1", "2", "--mode", "plain", "dflash", "--max-tokens", "6", "--repeats", "1",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    assert len(rows) == 4
    for row in rows:
        assert row["steps"] > 0 and 0 < row["host_us"] <= row["step_us"]
    assert HOST_SHAPE.hf_fields["num_hidden_layers"] == 2 and HOST_SHAPE.hf_fields["hidden_size"] == 64


def test_more_requests_than_the_batch_stream_through_it(tmp_path):
    out = tmp_path / "host.json"
    assert main(["--batch", "2", "--mode", "plain", "--requests", "5", "--max-tokens", "6", "--prompt-len", "4",
                 "--repeats", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 5 and row["case"] == "plain/2"
    assert 1 < row["tokens_per_step"] <= 2  # at most 2 requests run at once (max_num_seqs = batch)
    assert 0 < row["host_us"] <= row["step_us"] and row["model_us"] > 0


def test_the_context_length_sets_the_shape_and_is_checked(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["--batch", "2", "--mode", "dflash", "-k", "3", "--max-tokens", "6", "--repeats", "1",
                 "--max-model-len", "4096", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["shape"]["max_position_embeddings"] == 4096 and data["rows"][0]["steps"] > 0
    with pytest.raises(SystemExit):
        main(["--max-model-len", "0"])
    assert "--max-model-len must be >= 1, got 0" in capsys.readouterr().err
