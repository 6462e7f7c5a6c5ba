"""The dense training forward computes exactly what the paged inference path computes."""

import pytest
import torch

from blockdraft.attention.metadata import build_metadata
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.draft_block import build_draft_block
from blockdraft.training.dense import dense_block_forward
from blockdraft.training.masks import sample_anchors
from tests.conftest import tiny_config

B = 4
KV_BLOCK = 4


def _inference_hidden(drafter, feats, embeds, anchor):
    """write_context for positions < anchor, then one block forward at anchor (the engine's path)."""
    n_pages = (feats.shape[0] + B + KV_BLOCK) // KV_BLOCK + 1
    caches = drafter.allocate_kv_caches(n_pages, KV_BLOCK)
    pages = list(range(n_pages))
    meta = build_metadata([anchor], [anchor], [pages], KV_BLOCK)
    drafter.write_context(feats[:anchor], torch.arange(anchor), caches, meta.slot_mapping)
    block = build_draft_block(torch.tensor([0]), torch.tensor([anchor]), B, mask_token_id=0)
    bmeta = block.attention_metadata(meta.block_table, KV_BLOCK, host_lists=True)
    return drafter(embeds, torch.arange(anchor, anchor + B), caches, bmeta)


@pytest.mark.parametrize("layer_kw", [{}, {"causal_override": True},
                                      {"layer_types": ("full_attention", "sliding_attention"), "sliding_window": 5}])
def test_dense_forward_matches_paged_inference(layer_kw):
    target = tiny_config("qwen3")
    drafter = random_drafter(target, num_layers=2, block_size=B, target_layer_ids=(0, 2), seed=1, init_std=0.1, **layer_kw)
    g = torch.Generator().manual_seed(0)
    b, t, h = 2, 12, target.hidden_size
    feats = torch.randn(b, t, 2 * h, generator=g)
    lengths = torch.tensor([12, 9])
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[:, 3:] = True
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors=4, generator=g)
    embeds = torch.randn(b, anchors.shape[1] * B, h, generator=g)
    dense = dense_block_forward(drafter, feats, embeds, anchors, valid)
    for i in range(b):
        for j in range(anchors.shape[1]):
            if not valid[i, j]:
                continue
            a = int(anchors[i, j])
            rows = slice(j * B, (j + 1) * B)
            ref = _inference_hidden(drafter, feats[i], embeds[i, rows], a)
            torch.testing.assert_close(dense[i, rows], ref, rtol=1e-5, atol=1e-5)
            lm = torch.nn.Linear(h, target.vocab_size, bias=False)
            torch.testing.assert_close(drafter.compute_logits(dense[i, rows], lm), drafter.compute_logits(ref, lm))
