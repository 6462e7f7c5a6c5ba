"""The offline acceptance replay equals what the engine measures with the same drafter."""

import json

import pytest
import torch

from blockdraft.engine.request import SpecStats
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import export_drafter
from blockdraft.spec.draft_vocab import rank_dataset, write_dataset_draft_vocab
from blockdraft.training.acceptance import offline_acceptance, summarize, walk
from blockdraft.training.build import new_drafter
from blockdraft.training.target import EngineTarget
from blockdraft.training.trainer import TrainConfig, Trainer
from tests.conftest import EOS_ID, make_llm
from tests.training._tiny import MASK_ID, tiny_data


def test_walk_counts_like_greedy_verification():
    seq = torch.tensor([9, 1, 2, 3, 4, 5, 6])
    drafts = torch.full((7, 3), -1)
    drafts[1] = torch.tensor([2, 3, 7])  # 2 accepted -> next anchor 4
    drafts[4] = torch.tensor([5, 6, 7])  # 2 drafts allowed at most (max_tokens), both accepted
    # (drafts, accepted): the last step may draft only 1 (max_tokens)
    assert walk(seq, drafts, 1, 3, hit_max_tokens=True) == [(3, 2), (1, 1)]
    s = summarize([(3, 2), (3, 0)], 3)
    assert s["acceptance_length"] == 2.0 and s["per_position"] == [0.5, 0.5, 0.0]


def test_summarize_rates_count_only_the_steps_that_drafted_each_position():
    """A step cut short by max_tokens never proposed its later positions: not a rejection there."""
    s = summarize([(3, 3), (1, 1), (3, 0)], 4)
    assert s["drafted_per_position"] == [3, 2, 2, 0]
    assert s["per_position"] == [2 / 3, 1 / 2, 1 / 2, None]  # position 4: never drafted, no rate
    assert s["acceptance_length"] == (4 + 3) / 3 and s["num_steps"] == 3
    none = summarize([], 3)  # no step at all (answers that ended at their first token): valid JSON, no NaN
    assert none == {"acceptance_length": None, "num_steps": 0, "per_position": [None] * 3, "drafted_per_position": [0] * 3}
    json.dumps(none, allow_nan=False)


@pytest.mark.parametrize("draft_vocab_size", [0, 40])
def test_offline_acceptance_equals_the_engines(tmp_path, draft_vocab_size):
    target, data, prompts, _, _ = tiny_data(n=10, max_new_tokens=20)
    drafter = new_drafter(target.config, 1, block_size=4, intermediate_size=64, num_feature_layers=2,
                          mask_token_id=MASK_ID, seed=0)
    dv = None
    if draft_vocab_size:  # trained and replayed on the first 40 ranked ids, as the engine decodes
        dv = rank_dataset(data, target.config.vocab_size, (EOS_ID,), draft_vocab_size)[0]
    Trainer(drafter, EngineTarget(target.model, 4), data, TrainConfig(steps=30, batch_size=4, num_anchors=6, lr=3e-3),
            tmp_path, draft_vocab=dv).fit(progress=False)  # a drafter that accepts sometimes, not never
    export_drafter(drafter, tmp_path / "drafter")
    write_dataset_draft_vocab(tmp_path / "drafter", data, target.config.vocab_size, (EOS_ID,), "test")
    llm = make_llm(target, draft=str(tmp_path / "drafter"), draft_vocab_size=draft_vocab_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20))
    seqs = [torch.tensor(p + o.token_ids) for p, o in zip(prompts, outs)]
    offline = offline_acceptance(drafter.eval(), EngineTarget(target.model, 4), seqs, [len(p) for p in prompts], (EOS_ID,),
                                 draft_vocab=dv)
    steps = sum(o.spec.num_steps for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert offline["num_steps"] == steps
    assert offline["acceptance_length"] == (accepted + steps) / steps > 1.0
    pooled = SpecStats()
    for o in outs:
        pooled.merge(o.spec)
    k = len(offline["drafted_per_position"])  # the engine's lists end at the most drafts of a step
    assert offline["drafted_per_position"][: len(pooled.drafted_per_position)] == pooled.drafted_per_position
    assert offline["per_position"][: len(pooled.drafted_per_position)] == pooled.acceptance_rate_per_position()
    assert all(d == 0 for d in offline["drafted_per_position"][len(pooled.drafted_per_position) : k])
