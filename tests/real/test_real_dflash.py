"""DFlash on the real default target: speculative text == plain text (issue 3 acceptance)."""

import json
import subprocess
import sys

import pytest

from blockdraft.preflight import read_target_config
from blockdraft.spec.dflash.checkpoint import export_drafter, random_drafter

pytestmark = pytest.mark.slow
PROMPT = "Write a Python function that checks whether a number is prime."


def _cli(*args):
    cmd = [sys.executable, "-m", "blockdraft.cli", "generate", PROMPT, "--max-tokens", "24", "--json", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_generate_with_a_drafter_gives_the_plain_text(tmp_path):
    config = read_target_config("qwen2.5-coder-0.5b-instruct")[2]  # the drafter needs the shapes, not the weights
    export_drafter(random_drafter(config, num_layers=1, block_size=8, seed=3), tmp_path / "drafter")
    spec = _cli("--draft", str(tmp_path / "drafter"))
    plain = _cli("--no-draft")
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["num_drafted_tokens"] > 0 and spec["acceptance_length"] >= 1.0
    assert plain["acceptance_length"] is None
