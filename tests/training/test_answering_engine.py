"""train-drafter answers its prompts --max-num-seqs at a time (512 on CUDA, 32 on the CPU), with the
same answers whatever that number (fp32), and frees the answering engine before training."""

import weakref

import pytest

import blockdraft.llm
from blockdraft.cli import main
from blockdraft.training.dataset import TokenDataset
from blockdraft.training.pipeline import answering_engine_kwargs
from blockdraft.training.trainer import Trainer
from tests.training.test_train_drafter_e2e import NAME, _cached


def test_engine_arguments_per_device():
    assert answering_engine_kwargs("cpu", None, 8) == {"max_num_seqs": 32, "num_kv_blocks": 1024}
    assert answering_engine_kwargs("cpu", 3, 1000) == {"max_num_seqs": 3, "num_kv_blocks": 4000}
    assert answering_engine_kwargs("cuda", None, 8) == {"max_num_seqs": 512}  # pool from free memory
    assert answering_engine_kwargs("cuda:1", 64, 8) == {"max_num_seqs": 64}


@pytest.mark.skipif(not _cached(), reason="needs SmolLM2 and the data wheels in the cache (slow to fetch)")
def test_max_num_seqs_reaches_the_engine_changes_no_answer_and_the_engine_is_freed(tmp_path, capsys, monkeypatch):
    engines = []

    class Spy(blockdraft.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append((kwargs["max_num_seqs"], weakref.ref(self)))

    fit = Trainer.fit

    def fit_after_the_engine_is_gone(self, *args, **kwargs):
        assert engines and engines[-1][1]() is None, "the answering engine still holds its memory during training"
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(blockdraft.llm, "LLM", Spy)
    monkeypatch.setattr(Trainer, "fit", fit_after_the_engine_is_gone)
    data = {}
    for seqs in (None, "1"):
        out = tmp_path / f"seqs-{seqs}"
        flags = [] if seqs is None else ["--max-num-seqs", seqs]
        args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(out), "--num-prompts", "4",
                "--max-new-tokens", "8", "--steps", "1", "--device", "cpu", *flags]
        assert main(args) == 0
        capsys.readouterr()
        data[seqs] = TokenDataset.load(out / "data")
    assert [seqs for seqs, _ in engines] == [32, 1]
    assert len(data[None]) == len(data["1"]) == 4
    for i in range(4):  # one request at a time or all together: the same answers
        assert data[None].sequence(i)[0].tolist() == data["1"].sequence(i)[0].tolist()
