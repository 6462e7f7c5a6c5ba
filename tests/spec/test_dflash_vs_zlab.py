"""Our drafter == z-lab's `dflash.model.DFlashDraftModel` (PyPI dflash==0.1.0) on the same weights.

The oracle runs each request alone, with its whole context as `target_hidden` and the whole
block [bonus, MASK x (B - 1)] (B rows, as z-lab's `dflash_generate(block_size=B)`), at positions
0..P+B-1; its first K drafts are compared. Ours runs all requests in one batched block forward
over a paged cache (on the CPU the block keeps its B rows for any K).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.spec.dflash import DFlashSpeculator, random_drafter
from tests.spec._dflash_util import (
    TinyTarget,
    shuffled_block_table,
    slots_for,
    tiny_target_config,
    zlab_draft_logits,
    zlab_drafter,
)

pytest.importorskip("dflash.model", reason="z-lab reference package dflash==0.1.0 not installed")

KV_BLOCK_SIZE = 4
STD = 0.25  # large enough that the context visibly moves the drafts (0.02 leaves them constant)
CONTEXT_LENS = (5, 12, 9)  # P per request; deliberately not page-aligned

CASES = {
    "full": dict(),
    "sliding_causal_layer": dict(
        layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=5
    ),
    "sliding_no_window": dict(layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    "all_causal": dict(causal_override=True),
    "scaled": dict(output_multiplier=0.7, final_logit_softcapping=2.0, input_embedding_scale=1.5),
}


def _ours(drafter, target, features_per_req, bonus, k):
    """Drafts and logits from our speculator: per-request context written with real slots, then one block."""
    num_reqs = len(features_per_req)
    table = shuffled_block_table(num_reqs, 8, seed=3)
    spec = DFlashSpeculator(drafter, target, k, num_kv_blocks=num_reqs * 8, kv_block_size=KV_BLOCK_SIZE)
    feats, pos, slots = [], [], []
    for r, f in enumerate(features_per_req):
        p = torch.arange(f.shape[0])
        feats.append(f), pos.append(p), slots.append(slots_for(table[r], p, KV_BLOCK_SIZE))
    bonus_pos = torch.tensor([f.shape[0] for f in features_per_req])
    drafts = spec.propose(torch.cat(feats), torch.cat(pos), torch.cat(slots), bonus, bonus_pos, table)
    logits = spec.draft_logits(bonus, bonus_pos, table)
    return drafts, logits


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [3, 1])
def test_draft_logits_match_zlab(case, k):
    target_cfg = tiny_target_config()
    target = TinyTarget(target_cfg)
    drafter = random_drafter(target_cfg, num_layers=3, block_size=4, seed=7, init_std=STD, **CASES[case])
    zl = zlab_drafter(drafter)
    gen = torch.Generator().manual_seed(11)
    n_feat = drafter.config.num_aux_layers * target_cfg.hidden_size
    features = [torch.randn(p, n_feat, generator=gen) for p in CONTEXT_LENS]
    bonus = torch.randint(0, target_cfg.vocab_size, (len(CONTEXT_LENS),), generator=gen)

    drafts, logits = _ours(drafter, target, features, bonus, k)
    scale = drafter.config.input_embedding_scale
    for r, f in enumerate(features):
        # our block keeps the trained width (4 rows) for K = 1 too: z-lab's whole block, first K
        ref = zlab_draft_logits(zl, target, f, int(bonus[r]), drafter.config.block_size, scale)[:k]
        torch.testing.assert_close(logits[r], ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(drafts[r], ref.argmax(-1))


def test_context_moves_the_drafts():
    """Guard against vacuous comparisons: reversing the context must change logits and drafts."""
    target_cfg = tiny_target_config()
    target = TinyTarget(target_cfg)
    drafter = random_drafter(target_cfg, 3, 4, seed=7, init_std=STD)
    gen = torch.Generator().manual_seed(1)
    features = [torch.randn(p, 3 * 64, generator=gen) for p in CONTEXT_LENS]
    bonus = torch.tensor([3, 4, 5])
    drafts, logits = _ours(drafter, target, features, bonus, 3)
    drafts2, logits2 = _ours(drafter, target, [f.flip(0) for f in features], bonus, 3)
    assert (logits - logits2).abs().max() > 0.1 and not torch.equal(drafts, drafts2)
    assert len(set(drafts.flatten().tolist())) > 2


def test_sliding_window_actually_limits_context():
    """Guard against a vacuous sliding test: a window of 5 must change the logits vs no window."""
    target_cfg = tiny_target_config()
    target = TinyTarget(target_cfg)
    types = ("full_attention", "sliding_attention", "full_attention")
    gen = torch.Generator().manual_seed(0)
    features = [torch.randn(12, 3 * 64, generator=gen)]
    bonus = torch.tensor([5])
    out = []
    for window in (5, None):
        drafter = random_drafter(
            target_cfg, 3, 4, target_layer_ids=(1, 3, 5), seed=7, init_std=STD, layer_types=types, sliding_window=window
        )
        out.append(_ours(drafter, target, features, bonus, 3)[1])
    assert not torch.allclose(out[0], out[1], atol=1e-3)


def test_bf16_drafts_close_to_fp32():
    """Sanity for the GPU dtype: bf16 logits stay near fp32 ones (not an exactness claim)."""
    target_cfg = tiny_target_config()
    target = TinyTarget(target_cfg)
    gen = torch.Generator().manual_seed(2)
    features = [torch.randn(p, 5 * 64, generator=gen) for p in CONTEXT_LENS]
    bonus = torch.tensor([1, 2, 3])
    ids = (0, 1, 3, 5, 7)
    ref = _ours(random_drafter(target_cfg, 2, 4, ids, seed=1, init_std=STD), target, features, bonus, 3)[1]
    low_drafter = random_drafter(target_cfg, 2, 4, ids, seed=1, init_std=STD, dtype=torch.bfloat16)
    low = _ours(low_drafter, target.bfloat16(), features, bonus, 3)[1]
    torch.testing.assert_close(low, ref, atol=0.1, rtol=0.05)
