"""Growing a drafter's fused target layers (fc: [H, n*H] -> [H, n'*H], n' > n) keeps what it
computes: the init's fc column blocks move to the positions of their ids among the new ones, the
new ids' blocks are zero, so the new layers' features change nothing until trained
(training.build.init_from, as train-drafter --init-from --num-feature-layers and gpu_run use it)."""

import pytest
import torch

from blockdraft.training.build import feature_layer_ids, init_from, init_layer_ids, new_drafter, new_feature_layers
from blockdraft.training.dense import dense_block_forward
from blockdraft.training.target import EngineTarget
from blockdraft.training.trainer import TrainConfig, Trainer
from tests.conftest import tiny_config
from tests.training._tiny import MASK_ID, tiny_data

H = 64  # tiny_config's hidden size
DEEP = tiny_config(num_hidden_layers=24)  # the shipped Qwen drafter's target depth: ids 1..21 exist


def _drafter(ids, seed, layers=1, width=64, config=DEEP):
    return new_drafter(config, layers, block_size=4, intermediate_size=width, target_layer_ids=tuple(ids),
                       mask_token_id=MASK_ID, seed=seed)


def _trained_like(d, seed):
    """Non-trivial norms too (new_drafter sets them to 1): every weight of the init matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return d


def _inputs(seed, b=2, t=12, anchors=3, block=4):
    g = torch.Generator().manual_seed(seed)
    feats = {i: torch.randn(b, t, H, generator=g) for i in range(24)}  # each target layer's output
    embeds = torch.randn(b, anchors * block, H, generator=g)
    starts = torch.tensor([[0, 4, 7], [2, 5, 8]])
    return feats, embeds, starts, torch.ones_like(starts, dtype=torch.bool)


def _features(feats, ids):
    return torch.cat([feats[i] for i in ids], dim=-1)


@pytest.mark.parametrize("old_ids, new_ids", [((1, 11), (1, 6, 11)), ((1, 11, 21), feature_layer_ids(24, 5)),
                                              ((11, 21), (21, 1, 11))])  # any order: blocks follow their ids
def test_grown_features_give_the_init_drafters_outputs_whatever_the_new_layers_hold(old_ids, new_ids):
    old = _trained_like(_drafter(old_ids, seed=1, layers=2), seed=1)
    grown = _drafter(new_ids, seed=2, layers=2)
    assert init_from(grown, old.state_dict(), state_layer_ids=old_ids) == []
    assert new_feature_layers(grown, old.state_dict(), old_ids) == [i for i in new_ids if i not in old_ids]
    fc_old, fc_new = old.fc.weight, grown.fc.weight
    assert fc_new.shape == (H, len(new_ids) * H)
    for p, i in enumerate(new_ids):  # each block where its id sits in the new order; new ids' blocks zero
        block = fc_new[:, p * H:(p + 1) * H]
        if i in old_ids:
            j = old_ids.index(i)
            assert torch.equal(block, fc_old[:, j * H:(j + 1) * H])
        else:
            assert not block.any()
    for name, t in old.state_dict().items():  # every other weight is the init's
        assert name == "fc.weight" or torch.equal(grown.state_dict()[name], t)
    feats, embeds, anchors, valid = _inputs(3)
    lm_head = torch.nn.Linear(H, 96, bias=False)
    with torch.no_grad():
        want = dense_block_forward(old, _features(feats, old_ids), embeds, anchors, valid)
        got = dense_block_forward(grown, _features(feats, new_ids), embeds, anchors, valid)
        # equal up to fp32 rounding (default fp32 tolerance): a wider fc matmul may sum in another order
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grown.compute_logits(got.view(-1, H), lm_head),
                                   old.compute_logits(want.view(-1, H), lm_head))
        # other values in the new layers' slots change nothing at all (zero columns: bitwise)
        other = dict(feats)
        for i in new_ids:
            if i not in old_ids:
                other[i] = 100 * torch.randn(other[i].shape)
        assert torch.equal(dense_block_forward(grown, _features(other, new_ids), embeds, anchors, valid), got)


def test_the_init_ids_default_to_the_feature_layer_rule_for_the_fc_width():
    old = _trained_like(_drafter(feature_layer_ids(24, 3), seed=1), seed=1)  # (1, 11, 21): the shipped Qwen one's
    grown = _drafter(feature_layer_ids(24, 5), seed=2)
    assert init_layer_ids(grown, old.state_dict()) == (1, 11, 21)
    assert new_feature_layers(grown, old.state_dict()) == [6, 16]
    init_from(grown, old.state_dict())  # no ids given: derived from the fc width and num_target_layers
    fc = grown.fc.weight.view(H, 5, H)
    assert torch.equal(fc[:, [0, 2, 4]], old.fc.weight.view(H, 3, H)) and not fc[:, [1, 3]].any()
    same = _drafter(feature_layer_ids(24, 3), seed=3)  # equal widths: a plain copy, as before
    init_from(same, old.state_dict())
    assert torch.equal(same.fc.weight, old.fc.weight) and new_feature_layers(same, old.state_dict()) == []


def test_a_grown_drafter_starts_with_the_inits_loss_on_real_target_features(tmp_path):
    """Through the trainer: the grown drafter reads the tiny target's real features at its 3 ids."""
    target, data = tiny_data()[:2]
    cfg = TrainConfig(steps=4, batch_size=4, num_anchors=6, lr=3e-3, log_every=2, max_len=40)

    def trainer(n, out):
        d = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=n,
                        mask_token_id=MASK_ID, seed=n)
        return Trainer(d, EngineTarget(target.model, kv_block_size=4), data, cfg, out)

    small = trainer(2, tmp_path / "a")
    small.train_step()  # trained weights, not the fresh init
    grown = trainer(3, tmp_path / "b")
    assert small.drafter.config.target_layer_ids == (0, 2) and grown.drafter.config.target_layer_ids == (0, 1, 2)
    init_from(grown.drafter, small.drafter.state_dict())
    for step in range(2):
        torch.testing.assert_close(grown.loss_on(grown.prepare(step))[0], small.loss_on(small.prepare(step))[0],
                                   rtol=1e-6, atol=1e-6)
    grown.train_step()
    assert grown.drafter.fc.weight.view(H, 3, H)[:, 1].abs().sum() > 0  # the new layer's columns learn


def test_init_from_refuses_feature_layers_it_cannot_keep_naming_both_id_lists():
    old = _drafter((1, 11, 21), seed=1)
    # an init id the drafter does not read: its block would have nowhere to go
    with pytest.raises(ValueError, match=r"the init's target layer ids \[1, 11, 21\] are not all \(once each\) among "
                                         r"the drafter's \[1, 6, 11, 16, 20\] \(missing \[21\]\): feature layers can "
                                         r"be added, not removed or replaced"):
        init_from(_drafter((1, 6, 11, 16, 20), seed=2), old.state_dict(), state_layer_ids=(1, 11, 21))
    # fewer feature layers than the init: never cut
    with pytest.raises(ValueError, match=r"the init fuses 3 target layers \[1, 11, 21\], the drafter only 2 \[1, 11\]: "
                                         r"feature layers can be added, not removed"):
        init_from(_drafter((1, 11), seed=2), old.state_dict(), state_layer_ids=(1, 11, 21))
    with pytest.raises(ValueError, match=r"the init fuses 3 target layers, the drafter only 2 \[1, 11\]"):
        init_from(_drafter((1, 11), seed=2), old.state_dict())
    # as many ids as fc blocks; and the same width with other ids is not a plain copy
    with pytest.raises(ValueError, match=r"the init's target layer ids \[1, 11\] are 2, its 'fc.weight' fuses 3"):
        init_from(_drafter(feature_layer_ids(24, 5), seed=2), old.state_dict(), state_layer_ids=(1, 11))
    with pytest.raises(ValueError, match=r"ids \[1, 11, 21\] are not all \(once each\) among the drafter's "
                                         r"\[1, 6, 21\]"):
        init_from(_drafter((1, 6, 21), seed=2), old.state_dict(), state_layer_ids=(1, 11, 21))
    # the default ids of 3 of 24 layers, (1, 11, 21), are not all among those of 4, (1, 8, 14, 21)
    with pytest.raises(ValueError, match=r"\[1, 11, 21\] are not all .* among the drafter's \[1, 8, 14, 21\] "
                                         r"\(missing \[11\]\)"):
        init_from(_drafter(feature_layer_ids(24, 4), seed=2), old.state_dict())
    # another hidden size: the shape error as before
    wide = new_drafter(tiny_config(num_hidden_layers=24, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
                       1, block_size=4, intermediate_size=64, target_layer_ids=(1, 11, 21), mask_token_id=MASK_ID)
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(32, 96\), the drafter's is \(64, 320\)"):
        init_from(_drafter(feature_layer_ids(24, 5), seed=2), {"fc.weight": wide.fc.weight})
