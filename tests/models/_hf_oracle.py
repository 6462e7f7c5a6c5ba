"""Tiny random HF models (the oracle) and helpers to run ours on the same weights."""

from __future__ import annotations

import torch

from blockdraft.attention.metadata import build_metadata
from blockdraft.config import ModelConfig
from blockdraft.models import CausalLM, allocate_kv_caches, build_model

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def hf_model(family: str, seed: int = 0, **overrides):
    """A float32 HF *ForCausalLM with random weights (eager attention) and our ModelConfig for it.

    family: "llama" | "qwen2" | "qwen3". Non-zero biases / norm weights so they are exercised.
    """
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    cfg = cls_cfg(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls_model(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model, ModelConfig.from_hf_dict(cfg.to_dict())


def ours_from_hf(hf, config: ModelConfig, pack_weights: bool | None = None) -> CausalLM:
    """Our model (float32, CPU; packed weights by default where supported) loaded with the HF state dict."""
    model = build_model(config, torch.float32, "cpu", pack_weights=pack_weights)
    model.load_weights(hf.state_dict())
    return model


def hf_logits(hf, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One sequence [T] -> (logits [T, V] float32, hidden_states tuple of [T, H])."""
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    return out.logits[0].float(), tuple(h[0] for h in out.hidden_states)


def contiguous_pages(lengths: list[int], kv_block_size: int) -> list[list[int]]:
    """Disjoint page lists for requests of the given max lengths: 0.., then the next, ..."""
    tables, nxt = [], 0
    for n in lengths:
        k = -(-n // kv_block_size)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    return tables


def run_prefill(
    model: CausalLM,
    prompts: list[torch.Tensor],
    kv_block_size: int = 4,
    block_tables: list[list[int]] | None = None,
    num_kv_blocks: int = 64,
    aux_layer_ids: tuple[int, ...] = (),
):
    """All prompts in ONE ragged forward from an empty cache -> (logits [sum T, V], aux, caches, tables)."""
    lens = [len(p) for p in prompts]
    tables = block_tables or contiguous_pages(lens, kv_block_size)
    caches = allocate_kv_caches(model.config, num_kv_blocks, kv_block_size)
    meta = build_metadata(lens, lens, tables, kv_block_size)
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        hidden, aux = model(ids, positions, caches, meta, aux_layer_ids)
        return model.compute_logits(hidden), aux, caches, tables


class PagedRunner:
    """Drives our model step by step like the engine would: per request a token list, a (possibly
    shuffled) page list and a count of computed tokens; each step feeds a chosen number of the next
    tokens of several requests in one ragged forward and returns their logits per request."""

    def __init__(
        self, model: CausalLM, tokens: dict[str, torch.Tensor], pages: dict[str, list[int]], kv_block_size: int
    ) -> None:
        self.model, self.tokens, self.pages, self.kv_block_size = model, tokens, pages, kv_block_size
        num_pages = max(p for ps in pages.values() for p in ps) + 1
        self.caches = allocate_kv_caches(model.config, num_pages, kv_block_size)
        self.done = dict.fromkeys(tokens, 0)

    def step(self, schedule: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """schedule: (request, number of next tokens) pairs -> {request: logits [n, V]}."""
        ids, positions, seq_lens, query_lens, tables = [], [], [], [], []
        for req, n in schedule:
            start = self.done[req]
            ids.append(self.tokens[req][start : start + n])
            positions.append(torch.arange(start, start + n))
            seq_lens.append(start + n)
            query_lens.append(n)
            tables.append(self.pages[req])
            self.done[req] = start + n
        meta = build_metadata(seq_lens, query_lens, tables, self.kv_block_size)
        with torch.no_grad():
            hidden, _ = self.model(torch.cat(ids), torch.cat(positions), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        out, row = {}, 0
        for req, n in schedule:
            out[req] = logits[row : row + n]
            row += n
        return out
