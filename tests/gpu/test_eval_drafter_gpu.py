"""`blockdraft eval-drafter --device cuda` on the tiny model: both engines (speculative, then plain
for --compare-plain) size their KV pool from GPU memory, one after the other."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.cli import main  # noqa: E402
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]


def test_eval_drafter_runs_on_cuda_with_compare_plain(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("blockdraft.training.corpora.eval_prompts", lambda dataset, cache_dir=None: ["w05x w17x", "w33x"])
    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model)
    argv = ["eval-drafter", "--target", str(model), "--draft", str(drafter), "--num-prompts", "2",
            "--max-tokens", "8", "--compare-plain", "--device", "cuda"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cuda" and out["identical_to_plain"] and out["num_steps"] > 0
