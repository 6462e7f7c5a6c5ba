"""Dense, batched, differentiable DFlash drafter forward for training.

Same parameters and math as `DFlashDraftModel.write_context` + `forward` (the paged inference
path): context K/V = RoPE(k_norm(W_k c)), W_v c with c = hidden_norm(fc(features)); block rows are
pre-norm Qwen3 layers whose attention sees [context ; own block] (masks.block_attention_mask).
Only the attention call differs: one SDPA over all blocks of a batch with a boolean mask instead
of a paged cache. tests/training/test_dense.py checks the logits equal the inference path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.layers.rotary import apply_rotary
from blockdraft.spec.dflash.draft_model import DFlashAttention, DFlashDraftModel
from blockdraft.training.masks import block_attention_mask, block_positions


def _heads(x: torch.Tensor, b: int, n: int, heads: int, dim: int) -> torch.Tensor:
    """[b*n, heads, dim] -> [b, heads, n, dim] (SDPA layout)."""
    return x.view(b, n, heads, dim).transpose(1, 2)


def _attention(
    attn: DFlashAttention, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos, sin, mask, b: int
) -> torch.Tensor:
    """Block rows x [b*Q, H] attend to [context ; blocks] under `mask` [b, 1, Q, T+Q] -> [b*Q, H]."""
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(-1, h, d))
    k = attn.k_norm(attn.k_proj(x).view(-1, kvh, d))
    v = attn.v_proj(x).view(-1, kvh, d)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    n_q, n_t = x.shape[0] // b, ctx_k.shape[0] // b
    keys = torch.cat([_heads(ctx_k, b, n_t, kvh, d), _heads(k, b, n_q, kvh, d)], dim=2)
    vals = torch.cat([_heads(ctx_v, b, n_t, kvh, d), _heads(v, b, n_q, kvh, d)], dim=2)
    if h != kvh:  # GQA: expand explicitly (SDPA's enable_gqa limits the kernels it may pick)
        keys, vals = keys.repeat_interleave(h // kvh, dim=1), vals.repeat_interleave(h // kvh, dim=1)
    qh = _heads(q, b, n_q, h, d)
    out = F.scaled_dot_product_attention(qh, keys.to(qh.dtype), vals.to(qh.dtype), attn_mask=mask, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b * n_q, h * d))


def dense_block_forward(
    drafter: DFlashDraftModel,
    features: torch.Tensor,
    block_embeds: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """Run every draft block of a padded batch at once. Differentiable w.r.t. the drafter.

    Args:
        features: [b, T, n*H] target features at target_layer_ids (rows >= a sequence's length
            are padding; no valid block sees them because anchors < length).
        block_embeds: [b, A*B, H] embeddings of [anchor, MASK x (B-1)] per block (already times
            input_embedding_scale).
        anchors, valid: [b, A] (masks.sample_anchors); B = block_embeds.shape[1] // A.
    Returns:
        hidden [b, A*B, H] after the final norm (feed slots 1..B-1 to the target LM head).
    """
    b, t, _ = features.shape
    n_blocks = anchors.shape[1]
    block_size = block_embeds.shape[1] // n_blocks
    dtype = drafter.dtype  # master weights' dtype; autocast lowers the matmuls on its own
    c = drafter.project_context(features.reshape(b * t, -1))  # [b*T, H]
    ctx_pos = torch.arange(t, device=features.device).repeat(b)
    ctx_cos, ctx_sin = drafter.rotary_emb.cos_sin(ctx_pos, dtype)
    q_pos = block_positions(anchors, block_size).reshape(-1)
    cos, sin = drafter.rotary_emb.cos_sin(q_pos, dtype)
    masks: dict[tuple, torch.Tensor] = {}
    x = block_embeds.reshape(b * n_blocks * block_size, -1).to(dtype)
    for layer in drafter.layers:
        attn = layer.self_attn
        key = (attn.causal, attn.sliding_window)
        if key not in masks:  # one mask per distinct layer kind
            masks[key] = block_attention_mask(anchors, valid, t, block_size, *key)[:, None]
        ctx_k, ctx_v = attn.context_kv(c, ctx_cos, ctx_sin)
        x = x + _attention(attn, layer.input_layernorm(x), ctx_k, ctx_v, cos, sin, masks[key], b)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(b, n_blocks * block_size, -1)
