"""`blockdraft bench` on the real catalog model with its shipped drafter (CPU, fp32, tiny settings):
the HumanEval path end to end, and speculation lossless on real prompts."""

import json

import pytest

from blockdraft.bench.report import validate_report
from blockdraft.cli import main
from blockdraft.drafters import SHIPPED_DIR

pytestmark = pytest.mark.slow


def test_bench_real_model_with_shipped_drafter(tmp_path):
    args = ["bench", "--model", "qwen2.5-coder-0.5b-instruct", "--draft", "shipped", "--device", "cpu",
            "--dtype", "float32", "--batch-sizes", "2", "--max-tokens", "12", "--repeats", "1", "--warmup", "0",
            "--no-plot", "--out", str(tmp_path / "r")]
    assert main(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    validate_report(doc)
    parity = {(p["candidate"], p["batch_size"]): p["mismatched_requests"] for p in doc["parity"]}
    # batch 2 only: real-prompt lossless at batch 1 is pinned by test_real_dflash / test_real_demo /
    # test_real_prefix_cache (and the bench's batch-1 rows by the tiny-model bench tests)
    assert parity[("ours/dflash", 2)] == 0
    assert parity[("hf/plain", 2)] == 0
    rows = {(r["engine"], r["mode"], r["batch_size"]): r for r in doc["results"]}
    assert rows[("ours", "dflash", 2)]["acceptance_length"] >= 1.0
    shipped = json.loads((SHIPPED_DIR / "qwen2.5-coder-0.5b-instruct" / "config.json").read_text())
    assert doc["workload"]["dataset"] == "humaneval" and doc["settings"]["draft_layers"] == shipped["num_hidden_layers"]
