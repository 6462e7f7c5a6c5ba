"""Loss terms, learning on a fixed batch, the LR schedule, and exact resume from a checkpoint."""

import json
import math

import pytest
import torch

from blockdraft.training.build import new_drafter
from blockdraft.training.loss import StepStats, block_labels, default_gamma, slot_weights, weighted_block_loss
from blockdraft.training.target import EngineTarget
from blockdraft.training.trainer import TrainConfig, Trainer, lr_at, replan_steps
from tests.training._tiny import MASK_ID, tiny_data


@pytest.fixture(scope="module")
def tiny():
    return tiny_data()


def test_slot_weights_follow_the_paper():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    w = slot_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    assert math.isclose(float(w[7]), math.exp(-7 / 7), rel_tol=1e-6)


def test_block_labels_mask_prompt_padding_and_invalid_blocks():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    labels, keep = block_labels(ids, loss_mask, torch.tensor([5]), torch.tensor([[2, 3]]), torch.tensor([[True, False]]), 4)
    assert labels[0, 0].tolist() == [8, 9, 0] and keep[0, 0].tolist() == [True, True, False]  # pos 5 is padding
    assert not keep[0, 1].any()


def test_weighted_loss_is_the_weighted_mean_of_ce():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    labels = torch.tensor([1, 2, 3, 4, 5])
    slots = torch.tensor([0, 1, 2, 0, 2])
    w = slot_weights(4, 2.0)
    loss, stats = weighted_block_loss(logits, labels, slots, w)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert torch.allclose(loss, (ce * w[slots]).sum() / w[slots].sum())
    assert stats["count"].tolist() == [2, 1, 2]


def test_lr_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_frac=0.1, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


def test_a_short_run_still_warms_up():
    """A warmup share that rounds below one step (4 x 0.04 = 0.16) still starts below the peak lr:
    a short run from a trained drafter must not take its first step at the peak."""
    for steps in (2, 4, 12):
        cfg = TrainConfig(steps=steps, lr=1.0, warmup_frac=0.04, min_lr_ratio=0.1)
        assert lr_at(0, cfg) == pytest.approx(0.5) and lr_at(1, cfg) == pytest.approx(1.0), steps
    assert lr_at(0, TrainConfig(steps=100, lr=1.0, warmup_frac=0.04)) == pytest.approx(0.25)  # 4 steps: as before
    assert lr_at(0, TrainConfig(steps=4, lr=1.0, warmup_frac=0.0)) == 1.0  # no warmup asked: none
    assert lr_at(0, TrainConfig(steps=1, lr=1.0, warmup_frac=0.04)) == 1.0  # one step: it is the peak
    assert lr_at(0, TrainConfig(steps=4, lr=1.0, warmup_frac=0.04, warmup_steps=1)) == 1.0  # explicit: as given


def _trainer(tiny, out, steps, **kw):
    target, data = tiny[0], tiny[1]
    d = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID, seed=0)
    cfg = TrainConfig(steps=steps, batch_size=4, num_anchors=6, lr=3e-3, log_every=2, **kw)
    return Trainer(d, EngineTarget(target.model, kv_block_size=4), data, cfg, out)


def test_a_fixed_warmup_length_overrides_the_fraction():
    cfg = TrainConfig(steps=200, lr=1.0, warmup_frac=0.5, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(4, cfg) == pytest.approx(0.5) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(199, cfg) == pytest.approx(0.1, abs=1e-3)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"warmup_steps must be None or an integer >= 1, got {bad!r}"):
            TrainConfig(warmup_steps=bad)


def test_replan_steps_fills_the_budget_at_the_measured_pace():
    assert replan_steps(step=120, elapsed_s=12.0, pace_s=0.1, budget_s=60.0) == 600
    assert replan_steps(step=120, elapsed_s=70.0, pace_s=0.1, budget_s=60.0) == 121  # past the budget
    with pytest.raises(ValueError, match="pace_s must be > 0 seconds per step, got 0.0"):
        replan_steps(1, 1.0, 0.0, 10.0)


def _timed(monkeypatch, tr, seconds_of_step):
    """Step `tr` on a fake re-plan clock: optimizer step s (1-based) takes seconds_of_step(s)."""
    import blockdraft.training.trainer as trainer_mod

    clock = [0.0]
    monkeypatch.setattr(trainer_mod, "_clock", lambda: clock[0])
    monkeypatch.setattr(trainer_mod, "REPLAN_WARM_STEPS", 1)
    monkeypatch.setattr(trainer_mod, "REPLAN_FIRST", 2)
    step = tr.train_step

    def timed_step(prep=None):
        clock[0] += seconds_of_step(tr.step + 1)
        return step(prep)

    monkeypatch.setattr(tr, "train_step", timed_step)


@pytest.mark.parametrize("budget, planned, cost, final, warmup", [
    (30.0, 6, lambda s: 5.0 if s == 1 else 1.0, 26, 3),  # too short; the slow first step is not the pace
    (30.0, 6, lambda s: 5.0 if s == 1 else 1.0 if s <= 3 else 2.0, 15, 3),  # slower later: the second re-plan
    (5.0, 50, lambda s: 1.0, 5, 4),  # too long: shrinks, and the warmup (25) is cut to fit
    (20.0, 2, lambda s: 1.0, 20, 2),  # a plan shorter than the re-plan point is re-planned too (warmup: 2 x 0.5,
    # at least one step below the peak)
])
def test_a_time_budget_replans_the_schedule_from_the_pace(tiny, tmp_path, monkeypatch, budget, planned, cost,
                                                          final, warmup):
    """A plan made too short grows to the budget, one made too long shrinks to it, at the pace measured
    after the warm-up steps; the first plan's warmup length is kept (up to the new length - 1)."""
    from blockdraft.training.trainer import fit_together

    tr = _trainer(tiny, tmp_path, steps=planned, warmup_frac=0.5)
    _timed(monkeypatch, tr, cost)
    fit_together([tr], progress=False, budget_seconds=budget)
    assert tr.step == final and tr.cfg.steps == final and tr.cfg.warmup_steps == warmup
    saved = json.loads((tmp_path / "checkpoint" / "state.json").read_text())["train_config"]
    assert saved["steps"] == final and saved["warmup_steps"] == warmup


def test_a_replan_never_passes_max_steps(tiny, tmp_path, monkeypatch):
    """The budget would allow 20 steps; the epoch cap (max_steps 8) wins, and the schedule ends there."""
    from blockdraft.training.trainer import fit_together

    tr = _trainer(tiny, tmp_path, steps=6)
    _timed(monkeypatch, tr, lambda s: 1.0)
    fit_together([tr], progress=False, budget_seconds=20.0, max_steps=8)
    assert tr.step == 8 and tr.cfg.steps == 8


def test_epoch_cap_steps_counts_passes_over_the_data():
    from blockdraft.training.trainer import epoch_cap_steps

    assert epoch_cap_steps(1000, 64, 3.0) == 47  # ceil(3000 / 64)
    assert epoch_cap_steps(10, 64, 0.5) == 1
    with pytest.raises(ValueError, match="max_epochs must be > 0, got 0.0"):
        epoch_cap_steps(10, 4, 0.0)
    with pytest.raises(ValueError, match="num_sequences and batch_size must be >= 1, got 0, 4"):
        epoch_cap_steps(0, 4, 1.0)


def test_a_replanned_run_still_stops_at_until(tiny, tmp_path, monkeypatch):
    from blockdraft.training.trainer import fit_together

    tr = _trainer(tiny, tmp_path, steps=6)
    _timed(monkeypatch, tr, lambda s: 1.0)
    fit_together([tr], progress=False, budget_seconds=20.0, until=5)
    assert tr.step == 5 and tr.cfg.steps == 20  # interrupted: the schedule spans the re-planned 20


def test_without_a_budget_the_plan_stands(tiny, tmp_path):
    tr = _trainer(tiny, tmp_path, steps=5)
    tr.fit(progress=False)
    assert tr.step == 5 and tr.cfg.steps == 5 and tr.cfg.warmup_steps is None


def test_loss_decreases_on_a_fixed_batch(tiny, tmp_path):
    tr = _trainer(tiny, tmp_path, steps=40)
    tr.batch_indices = lambda step: [0, 1, 2, 3]  # the same batch every step
    prep = tr.prepare(0)  # and the same anchors
    first = float(tr.loss_on(prep)[0].detach())
    for _ in range(40):
        tr.train_step(prep)
    assert float(tr.loss_on(prep)[0].detach()) < 0.5 * first


def test_resume_replays_an_uninterrupted_run_exactly(tiny, tmp_path):
    straight = _trainer(tiny, tmp_path / "a", steps=6)
    straight.fit(progress=False)
    part = _trainer(tiny, tmp_path / "b", steps=6)
    part.fit(progress=False, until=3)  # interrupted half way
    resumed = _trainer(tiny, tmp_path / "b", steps=6)
    assert resumed.load_checkpoint() and resumed.step == 3
    resumed.fit(progress=False)
    for (k, a), b in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    files = sorted(p.name for p in (tmp_path / "b" / "checkpoint").iterdir())
    assert files == ["drafter.safetensors", "optimizer.safetensors", "state.json"]  # no pickles


def _cut_on_call(monkeypatch, module, name: str, call: int) -> None:
    """`module.name` raises KeyboardInterrupt (a second Ctrl-C) on its `call`-th call, before doing it."""
    real, calls = getattr(module, name), []

    def cut(*args, **kw):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(module, name, cut)


@pytest.mark.parametrize("where, left", [
    ("second file", 2),  # the new weights written, the optimizer state not: the step-2 set stays whole
    ("second rename", 4),  # checkpoint/ moved aside, checkpoint.new/ not yet in place: the new set is whole
])
def test_an_interrupted_save_leaves_one_whole_checkpoint_that_resumes_exactly(tiny, tmp_path, monkeypatch, where, left):
    """A checkpoint is several files; a save cut short anywhere leaves the previous set or the new
    one, never the weights of one step beside the state of another, and the resume replays the
    uninterrupted run bit for bit."""
    import safetensors.torch

    import blockdraft.training.atomic_folder as atomic_folder
    from blockdraft.training.trainer import read_checkpoint_state

    straight = _trainer(tiny, tmp_path / "a", steps=6)
    straight.fit(progress=False)
    out = tmp_path / "b"
    part = _trainer(tiny, out, steps=6)
    part.fit(progress=False, until=2)  # a checkpoint at step 2
    at_2 = (out / "checkpoint" / "drafter.safetensors").read_bytes()
    part.train_step()
    part.train_step()  # step 4, then its save is cut short
    if where == "second file":
        _cut_on_call(monkeypatch, safetensors.torch, "save_file", 2)
    else:
        _cut_on_call(monkeypatch, atomic_folder, "_rename", 2)
    with pytest.raises(KeyboardInterrupt):
        part.save_checkpoint()
    monkeypatch.undo()
    if where == "second file":
        assert (out / "checkpoint.new" / "drafter.safetensors").is_file()  # step 4's weights, set aside
        assert (out / "checkpoint" / "drafter.safetensors").read_bytes() == at_2
    else:
        assert not (out / "checkpoint").exists() and (out / "checkpoint.old").is_dir()
    assert read_checkpoint_state(out)["step"] == left  # found without changing anything
    resumed = _trainer(tiny, out, steps=6)
    assert resumed.load_checkpoint() and resumed.step == left
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]  # settled
    resumed.fit(progress=False)
    for (k, a), b in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_checkpoint_file_of_another_size_is_refused_and_an_older_checkpoint_loads(tiny, tmp_path):
    out = tmp_path / "run"
    _trainer(tiny, out, steps=4).fit(progress=False, until=2)
    state_file = out / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    optimizer = out / "checkpoint" / "optimizer.safetensors"
    assert state["files"] == {"drafter.safetensors": (out / "checkpoint" / "drafter.safetensors").stat().st_size,
                              "optimizer.safetensors": optimizer.stat().st_size}
    whole = optimizer.read_bytes()
    optimizer.write_bytes(whole[:100])  # a copy cut short
    with pytest.raises(ValueError, match=rf"checkpoint in {out / 'checkpoint'} is damaged: optimizer.safetensors has "
                                         rf"100 bytes, its state.json recorded {len(whole)} bytes .*--no-resume"):
        _trainer(tiny, out, steps=4).load_checkpoint()
    optimizer.write_bytes(whole)
    del state["files"]  # as written before the sizes were recorded: loads unchecked
    state_file.write_text(json.dumps(state))
    old = _trainer(tiny, out, steps=4)
    assert old.load_checkpoint() and old.step == 2


def _logged_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_a_resumed_run_logs_each_step_once(tiny, tmp_path):
    """Lines an interrupted run logged after its last checkpoint (and a line cut short) are dropped on
    resume: the resumed run redoes those steps and logs them again."""
    out = tmp_path / "run"
    _trainer(tiny, out, steps=8).fit(progress=False, until=4)  # checkpoint at step 4
    with open(out / "train_log.jsonl", "a") as f:  # died after logging step 6, mid-line at 7
        f.write(json.dumps({"step": 6, "loss": 1.0}) + "\n" + '{"step": 7, "lo')
    resumed = _trainer(tiny, out, steps=8)
    assert resumed.load_checkpoint() and resumed.step == 4
    assert _logged_steps(out) == [2, 4]
    resumed.fit(progress=False)
    assert _logged_steps(out) == [2, 4, 6, 8]


@pytest.mark.parametrize("recorded", [True, False])
def test_log_seconds_run_on_across_a_resume(tiny, tmp_path, monkeypatch, recorded):
    """train_log.jsonl's seconds go on from the checkpoint's training time after a resume (on a fake
    clock: 1 s a step), instead of restarting at 0; a checkpoint from before state.json recorded
    "seconds" goes on from its last logged line's."""
    import blockdraft.training.trainer as trainer_mod

    clock = [100.0]
    monkeypatch.setattr(trainer_mod, "_clock", lambda: clock[0])

    def timed(tr):
        step = tr.train_step

        def one_second_step(prep=None):
            clock[0] += 1.0
            return step(prep)

        tr.train_step = one_second_step
        return tr

    out = tmp_path / "run"
    timed(_trainer(tiny, out, steps=8)).fit(progress=False, until=5)  # logs steps 2, 4, 5; checkpoint at 5
    state_file = out / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["seconds"] == 5.0
    if not recorded:
        del state["seconds"]
        state_file.write_text(json.dumps(state))
    clock[0] = 7000.0  # a new process: another origin, and the time until the resume does not count
    resumed = timed(_trainer(tiny, out, steps=8))
    assert resumed.load_checkpoint() and resumed.seconds() == 5.0
    resumed.fit(progress=False)
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [(x["step"], x["seconds"]) for x in lines] == [(2, 2.0), (4, 4.0), (5, 5.0), (6, 6.0), (8, 8.0)]
    assert json.loads(state_file.read_text())["seconds"] == 8.0


def test_max_len_that_keeps_no_response_token_is_refused(tiny, tmp_path):
    """Sequences cut before their answers leave nothing to train on: refused naming max_len and the
    shortest prompt, instead of steps of loss 0 and NaN accuracies."""
    data = tiny[1]
    shortest = data.shortest_prompt()
    assert 3 <= shortest == min(len(p) for p in tiny[2])  # random_prompts: 3..19 tokens
    assert data.num_anchor_positions(shortest) == 0 and data.num_anchor_positions(shortest + 2) > 0
    assert data.num_anchor_positions(10**6) == sum(len(r) for r in tiny[3]) - len(data)  # last token: no label
    with pytest.raises(ValueError, match=rf"max_len \(--max-len\) {shortest} keeps no response token to train on in "
                                         rf"any of the {len(data)} training sequences \(the shortest prompt has "
                                         rf"{shortest} tokens"):
        _trainer(tiny, tmp_path, 2, max_len=shortest)
    _trainer(tiny, tmp_path, 2, max_len=shortest + 2)  # one anchor and its label fit: accepted


def test_data_with_ids_outside_the_targets_vocabulary_is_refused(tiny, tmp_path):
    from blockdraft.training.dataset import TokenDataset

    vocab = tiny[0].config.vocab_size
    data = TokenDataset.from_pairs([([1, 2, 3], [4, vocab, 5, 6])], [False], {"target": "bigger"})
    with pytest.raises(ValueError, match=rf"token ids 1..{vocab}, outside the target's vocabulary \[0, {vocab}\): it "
                                         rf"was made for another target \(recorded: 'bigger'\)"):
        _trainer((tiny[0], data), tmp_path, 2)


def test_resuming_with_other_settings_is_refused_naming_them(tiny, tmp_path):
    first = _trainer(tiny, tmp_path, steps=6)
    first.fit(progress=False, until=2)
    with pytest.raises(ValueError, match=r"steps=6 \(now 8\), lr=0.003 \(now 0.001\).*--no-resume"):
        other = _trainer(tiny, tmp_path, steps=8)
        other.cfg.lr = 1e-3
        other.load_checkpoint()
    with pytest.raises(ValueError, match=r"train_vocab_size=0 \(now 40\)"):
        target, data = tiny[0], tiny[1]
        d = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID,
                        seed=0)
        cfg = TrainConfig(steps=6, batch_size=4, num_anchors=6, lr=3e-3, log_every=2)
        Trainer(d, EngineTarget(target.model, kv_block_size=4), data, cfg, tmp_path,
                draft_vocab=torch.arange(40)).load_checkpoint()
    same = _trainer(tiny, tmp_path, steps=6)
    same.cfg.log_every = 3  # the logging cadence may change
    assert same.load_checkpoint() and same.step == 2


def test_progress_postfix_shows_slots_without_labels_as_na():
    from blockdraft.training.trainer import _postfix

    post = _postfix({"acc": [0.5] * 14 + [None], "loss": 2.0, "tau_proxy": 1.5})
    assert post == {"loss": "2.000", "tau": "1.50", "a1": "0.50", "a2": "0.50", "a4": "0.50", "a8": "0.50", "a15": "n/a"}


def test_logs_are_strict_json_when_slots_see_no_label(tiny, tmp_path):
    """Slots no label reached are null (not NaN, which strict JSON readers such as jq refuse)."""
    def refuse(constant):
        raise AssertionError(f"{constant} in a log")

    window = StepStats()
    window.add(2.0, {"correct": torch.tensor([1.0, 0.0, 0.0]), "count": torch.tensor([2.0, 0.0, 0.0])})
    summary = window.summary()
    assert summary["acc"] == [0.5, None, None] and summary["tau_proxy"] == 1.5
    assert json.loads(json.dumps(summary), parse_constant=refuse) == summary
    assert StepStats().summary()["acc_mean"] is None
    _trainer(tiny, tmp_path, steps=2).fit(progress=False)  # the files a run writes
    for line in (tmp_path / "train_log.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    json.loads((tmp_path / "checkpoint" / "state.json").read_text(), parse_constant=refuse)


@pytest.mark.parametrize("steps, step, total, want", [
    (100, 50, 60, 10),  # warmup done: kept
    (100, 5, 400, 10),  # a longer plan keeps it
    (100, 3, 50, 5),  # a plan half as long: half the warmup
    (25000, 120, 1000, 121),  # 25x shorter (warmup 1000): ends at the next step, the decay runs
    (50, 3, 4, 3),  # the plan ends at once: at least one step before the end
])
def test_a_replanned_warmup_shrinks_with_the_plan_and_leaves_room_to_decay(steps, step, total, want):
    from dataclasses import replace

    from blockdraft.training.trainer import replanned_warmup, warmup_length

    cfg = TrainConfig(steps=steps, lr=1.0, warmup_frac=0.04 if steps == 25000 else 0.1 if steps == 100 else 0.5,
                      min_lr_ratio=0.1)
    warmup = replanned_warmup(cfg, step, total)
    assert warmup == want
    new = replace(cfg, steps=total, warmup_steps=warmup)
    assert lr_at(total - 1, new) < 0.5 * cfg.lr or total - step <= 1  # decayed by the end
    if warmup_length(cfg) > step and step + 1 < total:  # cut mid-warmup: the rate does not step back down
        assert lr_at(step + 1, new) >= lr_at(step, cfg) - 1e-12
