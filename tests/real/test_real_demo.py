"""`blockdraft demo` on the real default model with its shipped drafter (issue 4: the README's command)."""

import json
import subprocess
import sys

import pytest

from blockdraft.demo import DEMO_PROMPTS
from blockdraft.layers.linear import cpu_has_fast_bf16

pytestmark = pytest.mark.slow


def test_demo_on_the_default_model_gives_the_plain_answers(tmp_path):
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "blockdraft.cli", "demo", *DEMO_PROMPTS[:2], "--max-tokens", "16", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    # bf16 (the checkpoint's dtype) where the CPU has a native bf16 path, else float32
    want = "bfloat16" if cpu_has_fast_bf16() else "float32"
    assert report["model"] == "qwen2.5-coder-0.5b-instruct" and report["dtype"] == want
    assert "drafters/qwen2.5-coder-0.5b-instruct" in report["draft"]
    assert [p["prompt"] for p in report["prompts"]] == list(DEMO_PROMPTS[:2])
    for p in report["prompts"]:
        assert p["identical_to_plain"] and p["num_output_tokens"] > 0 and p["text"].strip()
        assert p["num_drafted_tokens"] > 0 and p["acceptance_length"] >= 1.0
    assert report["summary"]["all_identical"]
    assert res.stdout.count("identical to plain: yes") == 2 and "summary:" in res.stdout
