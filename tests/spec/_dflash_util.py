"""Shared helpers for the DFlash tests: a tiny target stand-in, paging helpers, the z-lab oracle."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.config import ModelConfig
from blockdraft.spec.dflash import DFlashDraftModel


def tiny_target_config(**overrides) -> ModelConfig:
    """An 8-layer Qwen3-shaped target small enough for CPU tests."""
    fields = dict(
        arch="qwen3",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


class TinyTarget(nn.Module):
    """Stand-in for blockdraft.models CausalLM: only what the drafter borrows (embed, LM head)."""

    def __init__(self, config: ModelConfig, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    # z-lab's dflash_generate / compute_logits reach the target through these HF names.
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


def shuffled_block_table(num_reqs: int, pages_per_req: int, seed: int = 0) -> torch.Tensor:
    """[R, M] int32 with distinct, non-contiguous page ids (exercises paging)."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_reqs * pages_per_req, generator=gen)
    return pages.view(num_reqs, pages_per_req).to(torch.int32)


def slots_for(block_table_row: torch.Tensor, positions: torch.Tensor, kv_block_size: int) -> torch.Tensor:
    """Cache slot of each position of one request -> [T] int64."""
    pages = block_table_row.long()[positions // kv_block_size]
    return pages * kv_block_size + positions % kv_block_size


def padded(slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """slots with PADDING_SLOT where keep is False."""
    return torch.where(keep, slots, torch.full_like(slots, PADDING_SLOT))


def zlab_drafter(model: DFlashDraftModel):
    """z-lab's DFlashDraftModel built from OUR exported config dict and loaded with our weights (fp32)."""
    from dflash.model import DFlashDraftModel as ZLab
    from transformers import Qwen3Config

    hf = Qwen3Config.from_dict(model.config.to_hf_dict())
    zl = ZLab(hf).float().eval()
    zl.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=True)
    return zl


@torch.no_grad()
def zlab_draft_logits(zl, target: TinyTarget, features: torch.Tensor, bonus: int, num_query: int, scale: float = 1.0):
    """z-lab logits for one request: context features [P, n*H] at positions 0..P-1, block
    [bonus, MASK x (num_query-1)] at P..P+num_query-1 -> [num_query-1, V] (as dflash_generate)."""
    p = features.shape[0]
    ids = torch.full((1, num_query), zl.mask_token_id, dtype=torch.long)
    ids[0, 0] = bonus
    noise = nn.functional.embedding(ids, target.embed_tokens.weight) * scale
    hidden = zl(
        position_ids=torch.arange(p + num_query)[None],
        noise_embedding=noise,
        target_hidden=features[None].float(),
        past_key_values=None,
        use_cache=False,
    )
    return zl.compute_logits(hidden[:, 1:], target.lm_head)[0].float()
