"""Two tools of the long GPU runs, checked on the CPU: growing a drafter deeper keeps what it
computes (new layers start as identity), and a feature cache larger than the GPU memory left
trains on the seeded random part of the data that fits."""

from types import SimpleNamespace

import pytest
import torch

from blockdraft.training import gpu_run
from blockdraft.training.build import init_from, new_drafter
from blockdraft.training.dataset import TokenDataset
from blockdraft.training.features import sequences_that_fit
from blockdraft.training.target import EngineTarget
from blockdraft.training.trainer import TrainConfig, Trainer
from tests.training._tiny import MASK_ID, tiny_data


@pytest.fixture(scope="module")
def tiny():
    return tiny_data()


def _trainer(tiny, out, layers, intermediate_size=64):
    target, data = tiny[0], tiny[1]
    d = new_drafter(target.config, layers, block_size=4, intermediate_size=intermediate_size, num_feature_layers=2,
                    mask_token_id=MASK_ID, seed=layers)
    cfg = TrainConfig(steps=8, batch_size=4, num_anchors=6, lr=3e-3, log_every=2, max_len=40)
    return Trainer(d, EngineTarget(target.model, kv_block_size=4), data, cfg, out)


def test_a_grown_drafter_starts_with_the_smaller_drafters_loss_and_then_trains(tiny, tmp_path):
    small = _trainer(tiny, tmp_path / "a", 1)
    small.train_step()  # not the fresh init: trained weights carry over
    grown = _trainer(tiny, tmp_path / "b", 3)
    assert init_from(grown.drafter, small.drafter.state_dict()) == [1, 2]
    for step in range(2):
        batch = small.prepare(step)
        torch.testing.assert_close(grown.loss_on(batch)[0], small.loss_on(batch)[0], rtol=1e-5, atol=1e-6)
    before = grown.drafter.layers[2].self_attn.o_proj.weight.detach().clone()
    grown.train_step()
    grown.train_step()
    assert not torch.equal(before, grown.drafter.layers[2].self_attn.o_proj.weight)  # the new layers learn


def test_a_widened_drafter_starts_with_the_narrower_drafters_loss_and_its_new_units_learn(tiny, tmp_path):
    small = _trainer(tiny, tmp_path / "a", 1)
    small.train_step()
    wide = _trainer(tiny, tmp_path / "b", 2, intermediate_size=96)  # wider MLP and one more layer at once
    assert init_from(wide.drafter, small.drafter.state_dict()) == [1]
    down = wide.drafter.layers[0].mlp.down_proj.weight
    assert torch.equal(down[:, :64], small.drafter.layers[0].mlp.down_proj.weight) and not down[:, 64:].any()
    gate = wide.drafter.layers[0].mlp.gate_proj.weight
    assert torch.equal(gate[:64], small.drafter.layers[0].mlp.gate_proj.weight) and gate[64:].abs().sum() > 0
    for step in range(2):
        batch = small.prepare(step)
        torch.testing.assert_close(wide.loss_on(batch)[0], small.loss_on(batch)[0], rtol=1e-5, atol=1e-6)
    wide.train_step()
    assert down[:, 64:].abs().sum() > 0  # the new hidden units get gradient through their zero outputs


def test_init_from_names_a_tensor_that_does_not_fit(tiny):
    d = new_drafter(tiny[0].config, 1, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID)
    wide = new_drafter(tiny[0].config, 1, block_size=4, intermediate_size=96, num_feature_layers=2, mask_token_id=MASK_ID)
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.\w+_proj\.weight' has shape .* the MLP may only grow"):
        init_from(d, wide.state_dict())  # a narrower MLP than the init's: refused, never cut
    deep = new_drafter(tiny[0].config, 2, block_size=4, intermediate_size=64, num_feature_layers=2, mask_token_id=MASK_ID)
    with pytest.raises(ValueError, match=r"'layers\.1\..*' is not a parameter of this drafter \(1 layers\)"):
        init_from(d, deep.state_dict())


def _data(lengths):
    return TokenDataset.from_pairs([([7] * 2, list(range(n - 2))) for n in lengths], [i % 2 == 1 for i in range(len(lengths))])


def test_select_keeps_the_chosen_sequences_and_counts():
    data = _data([5, 8, 3, 10])
    part = data.select([3, 1])
    assert len(part) == 2 and part.lengths().tolist() == [10, 8]
    for j, i in enumerate([3, 1]):
        for a, b in zip(part.sequence(j), data.sequence(i)):
            assert torch.equal(a, b)
    assert part.info["num_tokens"] == 18 and part.info["num_response_tokens"] == 14 and part.info["num_sampled"] == 2
    with pytest.raises(IndexError, match="sequence index 4 outside 0..3"):
        data.select([4])


def test_sequences_that_fit_keep_a_seeded_random_part_within_the_budget():
    data = _data([10] * 20 + [30] * 10)  # 500 tokens, max_len 20 keeps 400
    assert sequences_that_fit(data, 20, 4, 1600) is None  # 400 tokens x 4 bytes fit exactly
    keep = sequences_that_fit(data, 20, 4, 1000, seed=3)
    kept_tokens = int(data.lengths().clamp(max=20)[keep].sum())
    assert keep == sorted(keep) and 1000 - 80 < kept_tokens * 4 <= 1000
    assert keep == sequences_that_fit(data, 20, 4, 1000, seed=3) != sequences_that_fit(data, 20, 4, 1000, seed=4)


def test_the_gpu_run_trains_on_what_fits_beside_the_reserve(monkeypatch):
    data = _data([10] * 40)  # 400 tokens
    hf = SimpleNamespace(config=SimpleNamespace(hidden_size=8), dtype=torch.bfloat16)  # 2 layers: 32 bytes/token
    args = SimpleNamespace(device="cuda", cache_reserve_gib=1.0, cache_host_gib=0.0, seed=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30 + 6400, 2**34))
    part, on_gpu = gpu_run._cacheable(args, data, hf, (1, 2), 1024)
    assert len(part) == 20 and part.info["num_tokens"] == 200 and on_gpu is None  # 6400 bytes / 32 per token
    # --cache-host-gib: host memory holds what the GPU cannot; the GPU part is what is left beside the reserve
    args.cache_host_gib = 3200 / 2**30
    part, on_gpu = gpu_run._cacheable(args, data, hf, (1, 2), 1024)
    assert len(part) == 30 and on_gpu == 6400
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**31, 2**34))
    assert gpu_run._cacheable(args, data, hf, (1, 2), 1024) == (data, 2**30)
    args.cache_host_gib = 0.0  # room for no sequence at all: said, not an empty cache
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30 + 100, 2**34))
    with pytest.raises(ValueError, match=r"no training sequence fits the feature cache's 0\.00 GiB .*--cache-reserve-gib 1"):
        gpu_run._cacheable(args, data, hf, (1, 2), 1024)


def test_the_feature_cache_refuses_data_made_for_another_target(tiny):
    from blockdraft.training.features import FeatureCache

    target = EngineTarget(tiny[0].model, kv_block_size=4)
    data = TokenDataset.from_pairs([([1, 2], [3, target.vocab_size])], [False], {"target": "other"})
    with pytest.raises(ValueError, match=rf"token ids 1..{target.vocab_size}, outside .* \(recorded: 'other'\)"):
        FeatureCache.build(target, data, (0,), 16, "cpu")
    with pytest.raises(ValueError, match="the feature cache needs at least one sequence, got an empty dataset"):
        FeatureCache.build(target, data.select([]), (0,), 16, "cpu")
