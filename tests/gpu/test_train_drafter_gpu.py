"""`blockdraft train-drafter --device cuda` on the tiny model: the target (bf16 by default on CUDA)
answers its prompts from a KV pool sized for --max-num-seqs requests, and that pool (and the engine's
graphs) is back with the allocator before training starts."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import blockdraft.llm  # noqa: E402
from blockdraft.cli import main  # noqa: E402
from blockdraft.training.trainer import Trainer  # noqa: E402
from tests.server.tiny_model import write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]  # compares memory_allocated before and after


def test_train_drafter_on_cuda_frees_the_answering_pool_before_training(tmp_path, monkeypatch, capsys):
    prompts = [[5 + i, 17, 33, 40 + i] for i in range(6)]
    monkeypatch.setattr("blockdraft.training.pipeline.select_training_prompts",
                        lambda tokenizer, settings, args: ([list(p) for p in prompts], {"used": len(prompts)}, []))
    engines = []

    class Spy(blockdraft.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches = [t for pair in self.engine.runner.kv_caches for t in pair]
            pool = sum(t.numel() * t.element_size() for t in caches)
            engines.append((kwargs["max_num_seqs"], [weakref.ref(t) for t in caches], pool,
                            torch.cuda.memory_allocated()))

    fit = Trainer.fit
    at_fit = []

    def fit_and_measure(self, *args, **kwargs):
        torch.cuda.synchronize()
        at_fit.append(torch.cuda.memory_allocated())
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(blockdraft.llm, "LLM", Spy)
    monkeypatch.setattr(Trainer, "fit", fit_and_measure)
    model = write_tiny_model(tmp_path / "model")
    argv = ["train-drafter", "--target", str(model), "--tiny", "--out", str(tmp_path / "run"), "--device", "cuda",
            "--num-prompts", "6", "--steps", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    (seqs, refs, pool, with_engine), = engines
    assert seqs == 6 and summary["data"]["max_num_seqs"] == 6 and summary["data"]["num_sequences"] == 6
    assert summary["data"]["dtype"] == "bfloat16" and summary["data"]["device"] == "cuda"
    assert all(ref() is None for ref in refs)
    assert at_fit[0] <= with_engine - pool  # the pool's memory went back before training


def test_train_drafter_on_cuda_validates_on_held_out_answers(tmp_path, monkeypatch, capsys):
    """--val-fraction on CUDA: validation runs under the bf16 autocast and the CUDA RNG fork, at step 0,
    every --val-every steps and at the end, and summary.json carries the last one."""
    prompts = [[5 + i, 17, 33, 40 + i] for i in range(6)]
    monkeypatch.setattr("blockdraft.training.pipeline.select_training_prompts",
                        lambda tokenizer, settings, args: ([list(p) for p in prompts], {"used": len(prompts)}, []))
    model = write_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    argv = ["train-drafter", "--target", str(model), "--tiny", "--out", str(out), "--device", "cuda",
            "--num-prompts", "6", "--steps", "3", "--val-fraction", "0.34", "--val-every", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    val = [r for r in lines if r.get("split") == "val"]
    assert [r["step"] for r in val] == [0, 2, 3] and all(r["sequences"] == 2 for r in val)
    assert summary["val"]["step"] == 3 and 1.0 <= summary["val"]["tau_proxy"] <= 16.0
