"""The two training shortcuts change the cost, not the objective: cached target features equal the
per-step ones, and the draft-vocabulary loss is the CE over those LM-head rows."""

import pytest
import torch
import torch.nn.functional as F

from blockdraft.training.build import new_drafter
from blockdraft.training.dataset import collate
from blockdraft.training.features import FeatureCache
from blockdraft.training.loss import weighted_block_loss
from blockdraft.training.target import EngineTarget
from blockdraft.training.trainer import TrainConfig, Trainer
from tests.training._tiny import MASK_ID, tiny_data


@pytest.fixture(scope="module")
def tiny():
    return tiny_data()


def _trainer(tiny, out, max_len=40, pad_multiple=64, **kw):
    target, data = tiny[0], tiny[1]
    d = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID, seed=0)
    cfg = TrainConfig(steps=8, batch_size=4, num_anchors=6, lr=3e-3, log_every=2, max_len=max_len, pad_multiple=pad_multiple)
    return Trainer(d, EngineTarget(target.model, kv_block_size=4), data, cfg, out, **kw)


def test_padding_batches_to_a_width_multiple_keeps_the_loss(tiny, tmp_path):
    exact, padded = _trainer(tiny, tmp_path / "a", 1024, 1), _trainer(tiny, tmp_path / "b", 1024, 64)
    for step in range(3):
        pe, pp = exact.prepare(step), padded.prepare(step)
        assert pp["feats"].shape[1] == 64 and pe["feats"].shape[1] < 64  # tiny sequences: 64 wide when padded
        torch.testing.assert_close(padded.loss_on(pp)[0], exact.loss_on(pe)[0])


def test_cached_features_equal_the_targets_per_batch(tiny, tmp_path):
    tr = _trainer(tiny, tmp_path)
    layers = tr.drafter.config.target_layer_ids
    cache = FeatureCache.build(tr.target, tr.data, layers, max_len=40, device="cpu", batch_size=5)
    assert cache.feats.shape[0] == int(tr.data.lengths().clamp(max=40).sum())
    for step in range(3):
        idx = tr.batch_indices(step)
        batch = collate(tr.data, idx, 40)
        want = tr.target.features(batch.input_ids, batch.lengths, layers)
        got = cache.batch(idx, batch.input_ids.shape[1])
        for r, n in enumerate(batch.lengths.tolist()):
            torch.testing.assert_close(got[r, :n], want[r, :n], atol=1e-5, rtol=1e-5)
            assert not got[r, n:].any()  # padding rows are zero


def test_a_cache_split_between_device_and_host_gives_the_same_batches(tiny, tmp_path):
    """device_bytes keeps the first sequences that fit on the device, the rest in host memory; a
    batch mixing both equals the unsplit cache's."""
    tr = _trainer(tiny, tmp_path)
    layers = tr.drafter.config.target_layer_ids
    whole = FeatureCache.build(tr.target, tr.data, layers, 40, "cpu", batch_size=5)
    row_bytes = whole.feats.shape[1] * whole.feats.element_size()
    budget = (whole.num_tokens // 2) * row_bytes
    split = FeatureCache.build(tr.target, tr.data, layers, 40, "cpu", batch_size=5, device_bytes=budget)
    assert whole.host_feats is None and split.host_feats is not None
    assert 0 < split.device_rows <= whole.num_tokens // 2 and split.device_rows in split.offsets  # at a boundary
    assert split.device_rows + split.host_feats.shape[0] == whole.num_tokens
    everyone = list(range(len(tr.data)))
    torch.testing.assert_close(split.batch(everyone, 40), whole.batch(everyone, 40), atol=0, rtol=0)
    assert FeatureCache.build(tr.target, tr.data, layers, 40, "cpu", device_bytes=whole.num_tokens * row_bytes
                              ).host_feats is None  # enough room: nothing on the host


def test_training_on_cached_features_matches_training_without(tiny, tmp_path):
    plain = _trainer(tiny, tmp_path / "a")
    cache = FeatureCache.build(plain.target, plain.data, plain.drafter.config.target_layer_ids, 40, "cpu")
    cached = _trainer(tiny, tmp_path / "b", features=cache)
    for _ in range(4):
        la, _ = plain.train_step()
        lb, _ = cached.train_step()
        assert la == pytest.approx(lb, rel=1e-4)


def test_draft_vocab_loss_is_ce_over_its_rows(tiny, tmp_path):
    full = _trainer(tiny, tmp_path / "a")
    vocab = full.target.vocab_size
    # every id, shuffled: the same objective as the full head (CE does not depend on column order)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    shuffled = _trainer(tiny, tmp_path / "b", draft_vocab=perm)
    prep = full.prepare(0)
    (lf, sf), (ls, ss) = full.loss_on(prep), shuffled.loss_on(prep)
    torch.testing.assert_close(ls, lf)
    torch.testing.assert_close(ss["correct"], sf["correct"])
    torch.testing.assert_close(ss["count"], sf["count"])

    # a subset: CE over its columns of the full logits, labels outside left out of the loss but counted
    sub = perm[: vocab // 2]
    part = _trainer(tiny, tmp_path / "c", draft_vocab=sub)
    loss, stats = part.loss_on(prep)
    b, a = prep["anchors"].shape
    from blockdraft.training.dense import dense_block_forward

    hidden = dense_block_forward(part.drafter, prep["feats"], prep["embeds"], prep["anchors"], prep["valid"])
    keep = prep["keep"]
    rows = hidden.view(b, a, 4, -1)[:, :, 1:][keep]
    labels = prep["labels"][keep]
    slots = torch.arange(3).expand_as(keep)[keep]
    logits = full.target.lm_head(rows)[:, sub]
    inside = torch.isin(labels, sub)
    assert 0 < int(inside.sum()) < labels.numel()  # the test covers both kinds of label
    local = (labels[inside, None] == sub).float().argmax(-1)
    want, want_stats = weighted_block_loss(logits[inside], local, slots[inside], part.weights)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(stats["correct"], want_stats["correct"])
    assert stats["count"].sum() == labels.numel()


def test_draft_vocab_training_learns(tiny, tmp_path):
    tr = _trainer(tiny, tmp_path, draft_vocab=torch.arange(tiny[0].config.vocab_size // 2, -1, -1))
    tr.batch_indices = lambda step: [0, 1, 2, 3]
    prep = tr.prepare(0)
    first = float(tr.loss_on(prep)[0].detach())
    for _ in range(30):
        tr.train_step(prep)
    assert float(tr.loss_on(prep)[0].detach()) < 0.5 * first


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([[1, 2]]), "1-D"),
    (torch.tensor([1, 10**6]), r"ids in \[0, "),
    (torch.tensor([3, 4, 3]), "repeats ids"),
])
def test_bad_draft_vocab_is_refused(tiny, tmp_path, ids, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tiny, tmp_path, draft_vocab=ids)


def test_a_feature_cache_built_for_other_settings_is_refused(tiny, tmp_path):
    tr = _trainer(tiny, tmp_path)
    layers = tr.drafter.config.target_layer_ids
    for cache_layers, max_len in ((layers, 32), (tuple(reversed(layers)), 40)):
        cache = FeatureCache.build(tr.target, tr.data, cache_layers, max_len, "cpu")
        with pytest.raises(ValueError, match="build it for this drafter, config and dataset"):
            _trainer(tiny, tmp_path, features=cache)


def test_device_split_and_host_buffer_refuse_what_cannot_be_held(monkeypatch):
    from blockdraft.training import features

    offsets = torch.tensor([0, 3, 7, 12])
    assert [features.device_split(offsets, 2, b) for b in (None, 24, 23, 14, 13, 5, 0)] == [12, 12, 7, 7, 3, 0, 0]
    with pytest.raises(ValueError, match="device_bytes must be >= 0 bytes or None, got -1"):
        features.device_split(offsets, 2, -1)
    assert features.available_host_bytes() > 0
    monkeypatch.setattr(features, "available_host_bytes", lambda: 40960)
    assert features.host_buffer(10, 100, torch.float32).shape == (10, 100)
    with pytest.raises(ValueError, match=r"needs 0\.0 GiB but only 0\.0 GiB of host memory is available: lower "
                                         r"--cache-host-gib"):
        features.host_buffer(100, 100, torch.float32)  # 40,000 bytes > 90 % of 40,960
