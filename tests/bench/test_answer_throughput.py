"""bench.answer_throughput: a CPU smoke run (tiny shape, eager sampler) and its argument errors."""

import json

import pytest
import torch

from blockdraft.bench import answer_throughput


def test_smoke_run_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--shape", "tiny", "--device", "cpu", "--requests", "10", "--max-num-seqs", "4", "--max-tokens", "6",
            "--min-prompt", "3", "--max-prompt", "12", "--repeats", "2", "--samplers", "eager", "--out", str(out)]
    assert answer_throughput.main(args) == 0
    assert "eager" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["runs"]["eager"]) == 2 and result["same_tokens"]
    assert all(r["tokens_per_s"] > 0 for r in result["runs"]["eager"]) and result["sampler_ms"]["eager"] > 0


@pytest.mark.parametrize("flag, value, message", [
    ("--samplers", "fast", "unknown ['fast']"),
    ("--requests", "0", "--requests must be >= 1"),
    ("--max-prompt", "2", "--max-prompt (2) must be >= --min-prompt (32)"),
])
def test_bad_arguments_name_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        answer_throughput.main(["--device", "cpu", flag, value])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    assert answer_throughput.main(["--shape", "tiny", "--requests", "2"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
