"""Held-out validation during drafter training: the seeded split, Trainer.validate (fixed batches and
anchors, no side effect on training), its lines in train_log.jsonl, and resuming with val settings."""

import json
import re

import pytest
import torch

from blockdraft.training.build import new_drafter
from blockdraft.training.dataset import MAX_VAL_SEQUENCES, TokenDataset, split_validation
from blockdraft.training.target import EngineTarget
from blockdraft.training.trainer import TrainConfig, Trainer, checkpoint_differences, fit_together
from blockdraft.training.validation import check_val_settings
from tests.training._tiny import MASK_ID, tiny_data


@pytest.fixture(scope="module")
def tiny():
    return tiny_data()


def _pairs(n: int) -> TokenDataset:
    """n sequences, sequence i = prompt [1, i] + answer [2] * (i % 5 + 1) (each one recognisable)."""
    return TokenDataset.from_pairs([([1, i], [2] * (i % 5 + 1)) for i in range(n)], [i % 3 == 0 for i in range(n)])


def _ids(data: TokenDataset) -> list[int]:
    return [int(data.sequence(i)[0][1]) for i in range(len(data))]


def test_the_split_is_seeded_disjoint_and_sized():
    data = _pairs(40)
    train, val = split_validation(data, 0.1, seed=3)
    assert len(val) == 4 and len(train) == 36
    assert sorted(_ids(train) + _ids(val)) == list(range(40))  # every sequence once, by whole sequence
    assert _ids(val) == sorted(_ids(val)) and _ids(train) == sorted(_ids(train))  # the order of `data` kept
    again = split_validation(data, 0.1, seed=3)
    assert _ids(again[1]) == _ids(val) and torch.equal(again[0].input_ids, train.input_ids)
    assert _ids(split_validation(data, 0.1, seed=4)[1]) != _ids(val)  # the seed decides which
    assert val.info["num_sequences"] == 4 and val.num_response_tokens() == sum(i % 5 + 1 for i in _ids(val))
    assert train.sampled.tolist() == [int(i % 3 == 0) for i in _ids(train)]
    # at least one held out, at most max_sequences (the rest trains); fraction 0: the data itself
    assert len(split_validation(data, 0.001, 0)[1]) == 1
    assert [len(p) for p in split_validation(data, 0.5, 0, max_sequences=7)] == [33, 7]
    assert split_validation(data, 0.0, 0) == (data, None) and split_validation(data, 0.0, 0)[0] is data
    assert MAX_VAL_SEQUENCES == 512  # train-drafter's and gpu_run's --val-fraction help say so


RANGE = "must be a number in [0, 1) (the share of the answers held out for validation; 0: none), got"


@pytest.mark.parametrize("n, fraction, message", [
    (40, -0.1, f"the validation fraction {RANGE} -0.1"),
    (40, 1.0, f"the validation fraction {RANGE} 1.0"),
    (40, float("nan"), f"the validation fraction {RANGE} nan"),
    (1, 0.2, "the validation fraction 0.2 holds out 1 of the 1 sequences, leaving none to train on"),
    (2, 0.9, "the validation fraction 0.9 holds out 2 of the 2 sequences, leaving none to train on"),
])
def test_a_split_that_cannot_be_made_is_refused_naming_the_fraction_and_count(n, fraction, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        split_validation(_pairs(n), fraction, 0)
    with pytest.raises(ValueError, match="max_sequences must be an integer >= 1, got 0"):
        split_validation(_pairs(4), 0.5, 0, max_sequences=0)


def _trainer(tiny, out, val_every=0, val=True, steps=6, features=False, **kw):
    target, data = tiny[0], tiny[1]
    train, held = split_validation(data, 0.25, seed=0)
    d = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID,
                    seed=0)
    cfg = TrainConfig(steps=steps, batch_size=2, num_anchors=6, lr=3e-3, log_every=2, val_every=val_every,
                      val_fraction=0.25, **kw)
    tt = EngineTarget(target.model, kv_block_size=4)
    cache = None
    if features:
        from blockdraft.training.features import FeatureCache

        cache = FeatureCache.build(tt, train, d.config.target_layer_ids, cfg.max_len, "cpu")
    return Trainer(d, tt, train, cfg, out, val_data=held if val else None, features=cache)


def _lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_validation_changes_nothing_training_reads_and_logs_val_lines(tiny, tmp_path):
    """The strong check: a run that validates every 2 steps ends with the very weights (and training
    log values) of a run that never validates; the validations are logged as "split": "val" lines."""
    on, off = _trainer(tiny, tmp_path / "on", val_every=2, steps=5), _trainer(tiny, tmp_path / "off", val=False, steps=5)
    on.fit(progress=False)
    off.fit(progress=False)
    for (k, a), b in zip(on.drafter.state_dict().items(), off.drafter.state_dict().values()):
        assert torch.equal(a, b), k
    assert torch.equal(on.optimizer.state_dict()["state"][0]["exp_avg"], off.optimizer.state_dict()["state"][0]["exp_avg"])
    lines = _lines(tmp_path / "on")
    val = [x for x in lines if x.get("split") == "val"]
    train = [x for x in lines if "split" not in x]  # the training lines are as they were
    drop = lambda x: {k: v for k, v in x.items() if k != "seconds"}  # noqa: E731
    assert [drop(x) for x in train] == [drop(x) for x in _lines(tmp_path / "off")]
    assert [x["step"] for x in val] == [0, 2, 4, 5]  # the start, every 2 steps, the end
    assert all(x["sequences"] == 3 and len(x["acc"]) == 3 and x["tau_proxy"] >= 1.0 for x in val)
    assert [drop(x) for x in on.val_history] == [drop(x) for x in val]
    assert val[-1]["loss"] < val[0]["loss"]  # it learned something the held-out answers show
    saved = json.loads((tmp_path / "on" / "checkpoint" / "state.json").read_text())
    assert [x["step"] for x in saved["val_history"]] == [0, 2, 4, 5] and saved["train_config"]["val_every"] == 2


def test_validate_is_repeatable_and_leaves_weights_mode_and_rng_alone(tiny, tmp_path):
    tr = _trainer(tiny, tmp_path)
    for _ in range(2):
        tr.train_step()
    weights = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    grads = [p.grad.clone() for p in tr.drafter.parameters()]  # step 2's, kept until the next step
    rng = torch.get_rng_state()
    first = tr.validate()
    assert torch.equal(torch.get_rng_state(), rng) and tr.drafter.training
    assert all(torch.equal(v, weights[k]) for k, v in tr.drafter.state_dict().items())
    assert all(torch.equal(p.grad, g) for p, g in zip(tr.drafter.parameters(), grads))  # no backward ran
    second = tr.validate()
    drop = lambda x: {k: v for k, v in x.items() if k != "val_seconds"}  # noqa: E731
    assert drop(first) == drop(second) and first["step"] == 2 and first["split"] == "val"
    batches = tr.val_batches()  # every held-out sequence once, in batches of cfg.batch_size, shortest first
    assert sorted(i for b in batches for i in b) == [0, 1, 2] and [len(b) for b in batches] == [2, 1]
    lengths = tr.val_data.lengths().tolist()
    assert [lengths[i] for b in batches for i in b] == sorted(lengths)
    # anchors are the validation batch's own, not a training step's: a later step validates the same blocks
    prep_a, prep_b = tr.prepare_val(0, tr.val_batches()[0]), tr.prepare_val(0, tr.val_batches()[0])
    assert torch.equal(prep_a["anchors"], prep_b["anchors"]) and torch.equal(prep_a["labels"], prep_b["labels"])
    tr.train_step()
    assert tr.validate()["loss"] != first["loss"]  # new weights, new numbers


def test_validation_never_reads_the_training_feature_cache(tiny, tmp_path):
    """The cache holds the training part's rows by its indices; validation runs the target on its own
    sequences, so with or without a cache the same weights validate to the same numbers."""
    cached, plain = _trainer(tiny, tmp_path / "a", features=True), _trainer(tiny, tmp_path / "b")
    assert cached.features is not None and len(cached.features) == len(cached.data) != len(cached.val_data)
    a, b = cached.validate(), plain.validate()
    assert {k: v for k, v in a.items() if k != "val_seconds"} == {k: v for k, v in b.items() if k != "val_seconds"}


def test_val_settings_are_checked(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"val_every 2 validates on held-out sequences: give the Trainer val_data"):
        _trainer(tiny, tmp_path, val_every=2, val=False)
    for bad in (-0.5, 1.0, True):
        with pytest.raises(ValueError, match=re.escape(f"val_fraction {RANGE} {bad!r}")):
            TrainConfig(val_fraction=bad)
    with pytest.raises(ValueError, match="val_every must be an integer >= 0, got -1"):
        TrainConfig(val_every=-1)
    with pytest.raises(ValueError, match=r"val_every 5 validates on the answers val_fraction F holds out: it needs "
                                         r"val_fraction F > 0 \(got 0.0\)"):
        TrainConfig(val_every=5)  # validation with nothing held out: caught when the config is made
    tr = _trainer(tiny, tmp_path, val=False)
    with pytest.raises(ValueError, match="this trainer has no val_data to validate on"):
        tr.val_batches()


def test_one_rule_checks_the_val_settings_naming_each_callers_flag():
    """check_val_settings owns the range and the pairing: TrainConfig, split_validation and the two
    commands (tests of train-drafter's and gpu_run's flags) give its messages, named their way."""
    for fraction in (-0.5, 1.0, float("nan"), True, "0.1"):
        for name, refuse in (("val_fraction", lambda f: TrainConfig(val_fraction=f)),
                             ("--val-fraction", lambda f: split_validation(_pairs(4), f, 0, name="--val-fraction")),
                             ("--val-fraction", lambda f: check_val_settings(f, 5))):  # the range before the pairing
            with pytest.raises(ValueError, match="^" + re.escape(f"{name} {RANGE} {fraction!r}") + "$"):
                refuse(fraction)
    for every in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="^" + re.escape(f"--val-every must be an integer >= 1 (steps between "
                                                             f"validations), got {every!r}") + "$"):
            check_val_settings(0.1, every)
    with pytest.raises(ValueError, match="^" + re.escape("--val-every 5 validates on the answers --val-fraction F "
                                                         "holds out: it needs --val-fraction F > 0 (got 0.0)") + "$"):
        check_val_settings(0.0, 5)
    check_val_settings(0.0)  # no cadence given: nothing held out is fine
    check_val_settings(0.25, 1)


def test_drafters_trained_together_validate_on_the_same_batches(tiny, tmp_path):
    a, b = _trainer(tiny, tmp_path / "a", val_every=3), _trainer(tiny, tmp_path / "b", val_every=3)
    b.val_data = a.val_data
    b.data = a.data
    with pytest.raises(ValueError, match="must share data, target"):  # another target object
        fit_together([a, b], progress=False)
    b.target = a.target
    fit_together([a, b], progress=False)
    assert [x["step"] for x in a.val_history] == [x["step"] for x in b.val_history] == [0, 3, 6]
    assert a.val_history[0]["loss"] == b.val_history[0]["loss"]  # same init, same batches: same numbers


def test_resume_keeps_val_every_free_and_refuses_another_val_fraction(tiny, tmp_path):
    from dataclasses import replace

    out = tmp_path / "run"
    _trainer(tiny, out, val_every=2, steps=8).fit(progress=False, until=4)  # checkpoint at step 4
    with open(out / "train_log.jsonl", "a") as f:  # died after validating step 6
        f.write(json.dumps({"split": "val", "step": 6, "loss": 1.0}) + "\n")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    cfg = _trainer(tiny, tmp_path / "x", val_every=2, steps=8).cfg
    assert checkpoint_differences(state, replace(cfg, val_every=3), 0) == []  # how often: may change
    assert checkpoint_differences(state, replace(cfg, val_fraction=0.5), 0) == ["val_fraction=0.25 (now 0.5)"]
    # a checkpoint from before validation existed: val_fraction 0, val_every not compared
    old = {**state, "train_config": {k: v for k, v in state["train_config"].items()
                                     if k not in ("val_fraction", "val_every")}}
    assert checkpoint_differences(old, replace(cfg, val_fraction=0.0, val_every=0), 0) == []
    assert checkpoint_differences(old, cfg, 0) == ["val_fraction=0.0 (now 0.25)"]
    resumed = _trainer(tiny, out, val_every=3, steps=8)  # validates every 3 from here on
    assert resumed.load_checkpoint() and [x["step"] for x in resumed.val_history] == [0, 2, 4]
    assert [x["step"] for x in _lines(out) if x.get("split") == "val"] == [0, 2, 4]  # step 6's line dropped
    resumed.fit(progress=False)
    assert [x["step"] for x in _lines(out) if x.get("split") == "val"] == [0, 2, 4, 6, 8]
    other = _trainer(tiny, out, val_every=2, steps=8)
    other.cfg = replace(other.cfg, val_fraction=0.5)
    with pytest.raises(ValueError, match=r"val_fraction=0.25 \(now 0.5\)"):
        other.load_checkpoint()
