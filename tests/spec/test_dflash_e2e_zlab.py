"""Whole greedy DFlash loop: our CausalLM + DFlashSpeculator vs z-lab's `dflash_generate` with an
HF Qwen3 target holding the same weights. Same tokens AND the same acceptance length every step,
which pins down the loop semantics (anchor positions, which rows feed the draft context, K + 1
query rows, target layer id offsets). z-lab drafts a block of K + 1 rows; we keep the drafter's
trained block width B for K < B - 1, so the loops are compared at K = B - 1, and K < B - 1 against
our own K = B - 1 drafts.
"""

from __future__ import annotations

import time

import pytest
import torch

from blockdraft.spec.dflash import DFlashSpeculator, random_drafter
from tests.spec._dflash_util import tiny_target_config, zlab_drafter

zlab = pytest.importorskip("dflash.model", reason="z-lab reference package dflash==0.1.0 not installed")

KV_BLOCK_SIZE = 4
NUM_PAGES = 32


def _targets():
    """(ours, HF) Qwen3 targets with identical random weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from blockdraft.models import build_model

    cfg = tiny_target_config()
    hf_cfg = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    ours = build_model(cfg)
    ours.load_weights(hf.state_dict())
    return cfg, ours, hf


class _OurLoop:
    """A single-request greedy DFlash loop on our pieces (what the model runner does, unbatched)."""

    def __init__(self, target, cfg, spec: DFlashSpeculator) -> None:
        from blockdraft.models import allocate_kv_caches

        self.target, self.spec = target, spec
        self.kv = allocate_kv_caches(cfg, NUM_PAGES, KV_BLOCK_SIZE)
        self.table = torch.arange(NUM_PAGES, dtype=torch.int32)[None]
        self.drafts: list[list[int]] = []  # every proposal, in order

    def _forward(self, ids: torch.Tensor, start: int):
        from blockdraft.attention import build_metadata

        n = ids.shape[0]
        meta = build_metadata([start + n], [n], self.table.tolist(), KV_BLOCK_SIZE)
        pos = torch.arange(start, start + n)
        hidden, aux = self.target(ids, pos, self.kv, meta, self.spec.aux_layer_ids)
        return self.target.compute_logits(hidden).argmax(-1), aux, pos, meta.slot_mapping

    def _propose(self, aux, pos, slots, bonus: int, bonus_pos: int) -> torch.Tensor:
        drafts = self.spec.propose(aux, pos, slots, torch.tensor([bonus]), torch.tensor([bonus_pos]), self.table)[0]
        self.drafts.append(drafts.tolist())
        return drafts

    def generate(self, prompt: torch.Tensor, max_new: int) -> tuple[list[int], list[int]]:
        """Returns (all tokens, committed tokens per verify step)."""
        out = prompt.tolist()
        argmax, aux, pos, slots = self._forward(prompt, 0)
        out.append(int(argmax[-1]))
        drafts = self._propose(aux, pos, slots, out[-1], len(prompt))
        steps = []
        while len(out) < len(prompt) + max_new:
            anchor_pos = len(out) - 1
            block = torch.cat([torch.tensor(out[-1:]), drafts])
            posterior, aux, pos, slots = self._forward(block, anchor_pos)
            accepted = int((drafts == posterior[:-1]).long().cumprod(0).sum())
            out += drafts[:accepted].tolist() + [int(posterior[accepted])]
            steps.append(accepted + 1)
            slots = slots.clone()
            slots[accepted + 1 :] = -1  # rejected drafts write no draft context
            drafts = self._propose(aux, pos, slots, out[-1], len(out) - 1)
        return out, steps


@pytest.mark.parametrize("k", [3, 5])
def test_greedy_loop_matches_zlab_dflash_generate(k, monkeypatch):
    cfg, ours, hf = _targets()
    drafter = random_drafter(cfg, num_layers=2, block_size=k + 1, seed=4, init_std=0.25)
    spec = DFlashSpeculator(drafter, ours, k, num_kv_blocks=NUM_PAGES, kv_block_size=KV_BLOCK_SIZE)
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(5))
    max_new = 24

    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats timer assumes CUDA
    zl = zlab_drafter(drafter)
    ref_drafts = []
    compute_logits = zl.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        ref_drafts.append(logits[0].argmax(-1).tolist())
        return logits

    monkeypatch.setattr(zl, "compute_logits", recording)
    ref = zlab.dflash_generate(
        zl, hf, prompt[None], max_new, None, temperature=0.0, block_size=k + 1, return_stats=True
    )
    loop = _OurLoop(ours, cfg, spec)
    tokens, steps = loop.generate(prompt, max_new)
    n = ref.output_ids.shape[1]
    assert tokens[:n] == ref.output_ids[0].tolist()
    # Near max_length z-lab shrinks the block (and truncates the last step): compare full blocks only.
    full, start, max_length = [], len(prompt), len(prompt) + max_new
    for produced in ref.acceptance_lengths:
        if max_length - start < k + 1:
            break
        full.append(produced)
        start += produced
    assert len(full) >= 4 and steps[: len(full)] == full
    # The drafts of every full-block step agree token for token (the sharp check: acceptance of a
    # random drafter is mostly 1, the drafts themselves depend on the whole context).
    assert loop.drafts[: len(full)] == ref_drafts[: len(full)]
    assert len({t for d in ref_drafts for t in d}) > 3


def test_k_below_the_block_drafts_the_whole_block_s_first_k():
    """K = 2 with a B = 6 drafter: the block keeps its 6 rows (as trained), so the drafts
    and their logits are the first 2 of K = 5's on the same context; a 3-row block (full_block=False,
    what z-lab runs for K = 2, and CUDA did before session 24) drafts otherwise."""
    cfg, ours, _ = _targets()
    drafter = random_drafter(cfg, num_layers=2, block_size=6, seed=4, init_std=0.25)
    full = DFlashSpeculator(drafter, ours, 5, num_kv_blocks=NUM_PAGES, kv_block_size=KV_BLOCK_SIZE)
    short = DFlashSpeculator(drafter, ours, 2, num_kv_blocks=NUM_PAGES, kv_block_size=KV_BLOCK_SIZE)
    assert (short.num_query_tokens, short.num_block_tokens) == (3, 6)
    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(6))
    argmax, aux, pos, slots = _OurLoop(ours, cfg, full)._forward(prompt, 0)
    bonus, bonus_pos = torch.tensor([int(argmax[-1])]), torch.tensor([len(prompt)])
    table = torch.arange(NUM_PAGES, dtype=torch.int32)[None]
    drafts = {s.num_speculative_tokens: s.propose(aux, pos, slots, bonus, bonus_pos, table) for s in (full, short)}
    assert drafts[2].shape == (1, 2) and drafts[2].tolist() == drafts[5][:, :2].tolist()
    logits = {s.num_speculative_tokens: s.draft_logits(bonus, bonus_pos, table) for s in (full, short)}
    torch.testing.assert_close(logits[2], logits[5][:, :2], rtol=0, atol=0)
    cut = DFlashSpeculator(drafter, ours, 2, num_kv_blocks=NUM_PAGES, kv_block_size=KV_BLOCK_SIZE, full_block=False)
    assert cut.num_block_tokens == 3
    cut.propose(aux, pos, slots, bonus, bonus_pos, table)
    assert not torch.allclose(cut.draft_logits(bonus, bonus_pos, table), logits[2])
