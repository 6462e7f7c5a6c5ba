"""TrainConfig.greedy_labels: block slots labelled with the target's argmax next token. For answers
the target decoded greedily nothing changes; for sampled answers the labels are the greedy tokens;
the cached and per-step paths agree; HF and our target compute the same argmax."""

import pytest
import torch

from blockdraft.training.build import new_drafter
from blockdraft.training.features import FeatureCache
from blockdraft.training.target import EngineTarget, HFTarget, greedy_ids
from blockdraft.training.trainer import (TrainConfig, Trainer, checkpoint_differences, fit_together,
                                         greedy_label_ids, on_greedy_chain)
from tests.training._tiny import MASK_ID, tiny_data


@pytest.fixture(scope="module")
def tiny():
    return tiny_data(n=12, max_new_tokens=20, sampled_fraction=0.5)


def _trainer(tiny, out, greedy_labels=True, **kw):
    target, data = tiny[0], tiny[1]
    d = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID,
                    seed=0)
    cfg = TrainConfig(steps=8, batch_size=4, num_anchors=6, lr=3e-3, log_every=2, max_len=40,
                      greedy_labels=greedy_labels)
    return Trainer(d, EngineTarget(target.model, kv_block_size=4), data, cfg, out, **kw)


def test_greedy_label_ids_shift_the_argmax_by_one():
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = torch.tensor([[16, 17, 18, 19]])
    assert greedy_label_ids(ids, greedy).tolist() == [[5, 16, 17, 18]]


def test_only_slots_on_the_greedy_chain_from_the_anchor_count():
    """Block at anchor 1 (B = 4): slots 1..3 are positions 2..4. The answer's token at 3 is not the
    greedy one, so slot 3 (position 4), reached only through position 3, is dropped; slot 2 is kept."""
    ids = torch.tensor([[1, 2, 3, 9, 5, 6]])
    labels = torch.tensor([[1, 2, 3, 4, 5, 6]])  # greedy_label_ids: position 3's greedy token is 4
    assert on_greedy_chain(ids, labels, torch.tensor([[1]]), 4).tolist() == [[[True, True, False]]]
    assert on_greedy_chain(labels, labels, torch.tensor([[1]]), 4).tolist() == [[[True, True, True]]]


def test_greedy_labels_change_nothing_for_greedy_answers(tiny, tmp_path):
    """Unsampled (greedy) answers: the same labels and kept slots as the answers' own tokens; sampled
    ones: a subset of the slots, slot 1 always kept."""
    greedy, plain = _trainer(tiny, tmp_path / "a"), _trainer(tiny, tmp_path / "b", greedy_labels=False)
    sampled = torch.tensor(tiny[4])
    dropped = 0
    for step in range(4):
        g, p = greedy.prepare(step), plain.prepare(step)
        rows = ~sampled[greedy.batch_indices(step)]
        assert torch.equal(g["keep"][rows], p["keep"][rows]) and torch.equal(g["labels"][rows], p["labels"][rows])
        assert not (g["keep"] & ~p["keep"]).any() and torch.equal(g["keep"][..., 0], p["keep"][..., 0])
        dropped += int((p["keep"] & ~g["keep"]).sum())
    assert dropped > 0


def test_a_checkpoint_from_before_greedy_labels_counts_as_trained_without_them():
    old = {"train_config": {k: v for k, v in TrainConfig().__dict__.items() if k not in ("greedy_labels", "warmup_steps")}}
    assert checkpoint_differences(old, TrainConfig(), 0) == []
    assert checkpoint_differences(old, TrainConfig(greedy_labels=True), 0) == ["greedy_labels=False (now True)"]


def test_greedy_answers_keep_their_labels_and_sampled_ones_take_the_argmax(tiny):
    """The engine decoded the unsampled answers greedily: the prefill's argmax after each position
    is the answer's next token there. Sampled answers (T = 0.7) differ somewhere."""
    target, data, prompts, responses, sampled = tiny
    t = EngineTarget(target.model, kv_block_size=4)
    layers = (0, 1)
    differ = 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        feats, greedy = t.features_and_greedy(ids, torch.tensor([ids.shape[1]]), layers)
        torch.testing.assert_close(feats, t.features(ids, torch.tensor([ids.shape[1]]), layers), atol=0, rtol=0)
        predicted = greedy[0, len(p) - 1 : -1].tolist()  # the argmax after each position before a response token
        if sampled[i]:
            differ += predicted != r
        else:
            assert predicted == r, i
    assert sum(sampled) >= 2 and differ >= 1


def test_cached_and_per_step_greedy_labels_agree(tiny, tmp_path):
    per_step = _trainer(tiny, tmp_path / "a")
    cache = FeatureCache.build(per_step.target, per_step.data, per_step.drafter.config.target_layer_ids, 40, "cpu",
                               batch_size=5, greedy=True)
    cached = _trainer(tiny, tmp_path / "b", features=cache)
    plain = _trainer(tiny, tmp_path / "c", greedy_labels=False)
    moved = 0
    for step in range(4):
        a, b, c = per_step.prepare(step), cached.prepare(step), plain.prepare(step)
        assert torch.equal(a["keep"], b["keep"]) and torch.equal(a["labels"], b["labels"])
        moved += int((a["labels"] != c["labels"])[a["keep"]].sum())
    assert moved > 0  # the sampled answers' labels changed
    for _ in range(3):
        la, _ = per_step.train_step()
        lb, _ = cached.train_step()
        assert la == pytest.approx(lb, rel=1e-4)


def test_greedy_labels_refuse_a_cache_without_greedy_tokens_and_mixed_lockstep(tiny, tmp_path):
    target = EngineTarget(tiny[0].model, kv_block_size=4)
    cache = FeatureCache.build(target, tiny[1], (0, 2), 40, "cpu")
    with pytest.raises(ValueError, match=r"greedy_labels needs the target's greedy tokens in the feature cache"):
        _trainer(tiny, tmp_path / "a", features=cache)
    with pytest.raises(ValueError, match="this feature cache holds no greedy tokens: build it with greedy=True"):
        cache.greedy_batch([0], 8)
    with pytest.raises(ValueError, match="greedy_labels must be True or False, got 1"):
        TrainConfig(greedy_labels=1)
    with pytest.raises(ValueError, match="must share data, target, seed, batch settings, step, greedy_labels"):
        fit_together([_trainer(tiny, tmp_path / "b"), _trainer(tiny, tmp_path / "c", greedy_labels=False)],
                     progress=False)


def test_hf_target_greedy_is_the_argmax_of_its_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (2, 11))
    feats, greedy = HFTarget(model).features_and_greedy(ids, torch.tensor([11, 11]), (0, 1))
    with torch.no_grad():
        want = model(ids).logits.argmax(-1)
    assert torch.equal(greedy, want) and feats.shape == (2, 11, 64)


def test_greedy_ids_work_in_chunks(monkeypatch):
    import blockdraft.training.target as target_mod

    head = torch.nn.Linear(8, 50, bias=False)
    rows = torch.randn(13, 8)
    monkeypatch.setattr(target_mod, "GREEDY_CHUNK_ROWS", 4)
    assert torch.equal(greedy_ids(head, rows), head(rows).argmax(-1))
