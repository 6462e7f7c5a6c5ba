"""DFlashSpeculator: K validation, protocol, static shapes, and incremental context writes."""

from __future__ import annotations

import pytest
import torch

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.spec.base import Speculator
from blockdraft.spec.dflash import DFlashSpeculator, random_drafter
from tests.spec._dflash_util import TinyTarget, padded, shuffled_block_table, slots_for, tiny_target_config

KV_BLOCK_SIZE = 4
PAGES_PER_REQ = 8


def _setup(k=3, **kw):
    target_cfg = tiny_target_config()
    drafter = random_drafter(target_cfg, num_layers=2, block_size=4, seed=5, init_std=0.25, **kw)
    target = TinyTarget(target_cfg)
    spec = DFlashSpeculator(drafter, target, k, num_kv_blocks=2 * PAGES_PER_REQ, kv_block_size=KV_BLOCK_SIZE)
    return spec, shuffled_block_table(2, PAGES_PER_REQ, seed=9)


@pytest.mark.parametrize("k", [0, 4, -1, True, 2.0])
def test_num_speculative_tokens_out_of_range(k):
    drafter = random_drafter(tiny_target_config(), num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DFlashSpeculator(drafter, TinyTarget(tiny_target_config()), k, num_kv_blocks=4, kv_block_size=4)


def test_defaults_and_protocol():
    drafter = random_drafter(tiny_target_config(), num_layers=2, block_size=4, target_layer_ids=(2, 6))
    spec = DFlashSpeculator(drafter, TinyTarget(tiny_target_config()), None, num_kv_blocks=4, kv_block_size=4)
    assert spec.num_speculative_tokens == 3 and spec.aux_layer_ids == (2, 6) and spec.num_query_tokens == 4
    assert isinstance(spec, Speculator)
    k_cache, v_cache = spec.kv_caches[0]
    assert len(spec.kv_caches) == 2 and k_cache.shape == v_cache.shape == (4, 4, 2, 16)


def _features(n_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(n_rows, 2 * 64, generator=torch.Generator().manual_seed(seed))


def test_incremental_writes_match_one_shot():
    """Context fed over three steps, with rejected rows padded (garbage features, PADDING_SLOT) and
    requests of different lengths, drafts exactly like writing each whole context at once."""
    lens = (11, 14)
    ctx = [_features(n + 4, seed=r) for r, n in enumerate(lens)]  # + room for rejected rows
    bonus = torch.tensor([5, 9])
    bonus_pos = torch.tensor(lens)

    one_shot, table = _setup()
    feats = torch.cat([c[:n] for c, n in zip(ctx, lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([slots_for(table[r], torch.arange(n), KV_BLOCK_SIZE) for r, n in enumerate(lens)])
    want = one_shot.propose(feats, pos, slots, bonus, bonus_pos, table)
    want_logits = one_shot.draft_logits(bonus, bonus_pos, table)

    inc, _ = _setup()
    # (start, rows this step, rows committed) per request and step; uncommitted rows are garbage.
    steps = [((0, 6, 6), (0, 5, 5)), ((6, 4, 2), (5, 4, 4)), ((8, 4, 3), (9, 5, 5))]
    for step in steps:
        feats, pos, slots = [], [], []
        for r, (start, n, keep) in enumerate(step):
            p = torch.arange(start, start + n)
            f = ctx[r][start : start + n].clone()
            f[keep:] = torch.randn(n - keep, f.shape[1]) * 5  # rejected drafts' features
            feats.append(f)
            pos.append(p)
            slots.append(padded(slots_for(table[r], p, KV_BLOCK_SIZE), torch.arange(n) < keep))
        step_bonus_pos = torch.tensor([start + keep for start, _, keep in step])
        got = inc.propose(torch.cat(feats), torch.cat(pos), torch.cat(slots), bonus, step_bonus_pos, table)
    assert [s[0] + s[2] for s in steps[-1]] == list(lens)  # the steps cover each context exactly
    assert torch.equal(got, want)
    torch.testing.assert_close(inc.draft_logits(bonus, bonus_pos, table), want_logits, atol=1e-5, rtol=1e-5)


def test_block_kv_never_enters_the_cache():
    spec, table = _setup()
    n = 6
    pos = torch.arange(n)
    spec.propose(_features(n, 0), pos, slots_for(table[0], pos, KV_BLOCK_SIZE), torch.tensor([1]),
                 torch.tensor([n]), table[:1])
    block_slots = slots_for(table[0], torch.arange(n, n + 4), KV_BLOCK_SIZE)
    for k_cache, v_cache in spec.kv_caches:
        assert not k_cache.flatten(0, 1)[block_slots].any() and not v_cache.flatten(0, 1)[block_slots].any()
        assert k_cache.flatten(0, 1)[slots_for(table[0], pos, KV_BLOCK_SIZE)].abs().sum() > 0


def test_propose_shapes_and_padding_rows_write_nothing():
    spec, table = _setup(k=2)
    slots = torch.full((5,), PADDING_SLOT, dtype=torch.long)
    drafts = spec.propose(_features(5, 1), torch.arange(5), slots, torch.tensor([3, 4]), torch.tensor([0, 0]), table)
    assert drafts.shape == (2, 2) and drafts.dtype == torch.long
    assert all(not k.any() and not v.any() for k, v in spec.kv_caches)
    # An empty context (P = 0) is allowed: the block attends only to itself.
    assert torch.equal(drafts[0], spec.draft_logits(torch.tensor([3]), torch.tensor([0]), table[:1])[0].argmax(-1))


@pytest.mark.parametrize("transform", [{}, {"output_multiplier": 0.5}, {"final_logit_softcapping": 3.0}])
def test_argmax_only_logits_skip_the_float32_copy_only_when_nothing_transforms_them(transform):
    """propose() asks for logits with upcast=False: in the LM head's dtype when neither
    output_multiplier nor softcapping applies (same argmax, no [N, V] float32 copy), else float32."""
    drafter = random_drafter(tiny_target_config(), num_layers=1, block_size=4, seed=1, **transform)
    weight = torch.randn(97, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    head = lambda h: torch.nn.functional.linear(h, weight)  # noqa: E731
    full = drafter.compute_logits(hidden, head)
    fast = drafter.compute_logits(hidden, head, upcast=False)
    assert full.dtype == torch.float32
    assert fast.dtype == (torch.bfloat16 if not transform else torch.float32)
    assert torch.equal(fast.argmax(-1), full.argmax(-1))
    if not transform:
        assert torch.equal(fast.float(), full)


def test_full_vocabulary_proposals_skip_the_float32_copy_of_the_target_head():
    """Without a draft vocabulary propose() scores with the target's head in the model dtype
    (no [R*K, V] float32 copy, ~0.3 GB per step at 32 requests x 15 drafts x 152K ids); the
    argmax, and so the drafts, equal those of the float32 logits."""
    cfg = tiny_target_config()
    drafter = random_drafter(cfg, num_layers=2, block_size=4, seed=5, init_std=0.25).to(torch.bfloat16)
    target = TinyTarget(cfg).to(torch.bfloat16)
    spec = DFlashSpeculator(drafter, target, 3, num_kv_blocks=2 * PAGES_PER_REQ, kv_block_size=KV_BLOCK_SIZE)
    table = shuffled_block_table(2, PAGES_PER_REQ, seed=9)
    assert spec.kv_caches[0][0].dtype == torch.bfloat16
    bonus, bonus_pos = torch.tensor([5, 9]), torch.tensor([0, 0])
    fast = spec.draft_logits(bonus, bonus_pos, table, upcast=False)
    full = spec.draft_logits(bonus, bonus_pos, table)
    assert fast.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(fast.float(), full)
    slots = torch.full((2,), PADDING_SLOT, dtype=torch.long)
    drafts = spec.propose(_features(2, 1).to(torch.bfloat16), torch.arange(2), slots, bonus, bonus_pos, table)
    assert torch.equal(drafts, full.argmax(-1))


def test_a_block_of_another_width_is_refused():
    from blockdraft.spec.dflash.draft_block import build_draft_block

    spec, table = _setup(k=2)
    block = build_draft_block(torch.tensor([3]), torch.tensor([0]), spec.num_block_tokens + 1, spec.mask_token_id)
    with pytest.raises(ValueError, match=f"draft block has {spec.num_block_tokens + 1} rows per request"):
        spec.block_logits(block, table[:1])
