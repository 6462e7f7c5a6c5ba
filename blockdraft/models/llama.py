"""Llama / Qwen2 / Qwen3 causal LMs in one class, configured by ModelConfig.

Differences between the families are all config switches: q/k/v bias (`attention_bias`; Qwen2
always, with an unbiased o_proj), per-head q/k RMSNorm before RoPE (`qk_norm`, Qwen3), RoPE theta
and scaling, tied or untied LM head, and per-layer sliding windows (`layer_types`).

Rows of a forward are the flattened tokens of a ragged batch ([T], no batch dimension); the
AttentionMetadata says which rows belong to which request and where their K/V goes.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.attention.metadata import AttentionMetadata
from blockdraft.attention.torch_ref import paged_attention
from blockdraft.config import ModelConfig
from blockdraft.layers.attention import Attention, AttentionBackend
from blockdraft.layers.embedding import VocabEmbedding
from blockdraft.layers.linear import Linear, load_hf_state_dict
from blockdraft.layers.mlp import GatedMLP
from blockdraft.layers.norm import RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding

# Checkpoint entries that carry no weights we need (old HF checkpoints saved the RoPE buffer).
_IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)). [rows, hidden] -> [rows, hidden]."""

    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        sliding = config.layer_types[layer_id] == "sliding_attention"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            qkv_bias=config.attention_bias,
            # Qwen2 biases q/k/v only; Llama / Qwen3 `attention_bias` covers o_proj too (as in HF).
            o_bias=config.attention_bias and config.arch != "qwen2",
            qk_norm=config.qk_norm,
            rms_norm_eps=config.rms_norm_eps,
            sliding_window=config.sliding_window if sliding else None,
            backend=backend,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Out-of-place residual adds: the returned tensor may be kept as an aux hidden state.
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """HF's `model.` submodule: embed_tokens, layers, norm (and the shared rotary table)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class CausalLM(nn.Module):
    """Target model for the engine (and the embedding / LM head the DFlash drafter borrows).

    Parameter names are HF's except the stacked `qkv_proj` / `gate_up_proj`; `load_weights`
    takes an HF state dict. Build with `blockdraft.models.build_model`.

    Args:
        config: the normalised architecture.
        backend: paged attention function (default: the torch reference, CPU path).
        pack_weights: after loading, pack the matmul weights for oneDNN (CPU fp32 / bf16 only;
            inference-only; see blockdraft.layers.linear).
    Parameters are left uninitialised: use build_model, then load_weights.
    """

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend = paged_attention, pack_weights: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.pack_weights = pack_weights
        self.packed = False
        self.model = DecoderStack(config, backend)
        # Tied: compute_logits uses embed_tokens (no second parameter).
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Use the paged attention function `backend` in every layer (see blockdraft.attention.backends)."""
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden] in the model dtype."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] (after the final norm) -> logits [N, vocab] float32.

        Pass only the rows you need (e.g. the last row of each prompt): the LM head is the
        largest matmul of a decode step. `out` ([N, vocab] float32): write there instead of a new
        tensor (CUDA graphs keep one logits buffer for every bucket); the float32 cast is the copy.
        """
        logits = self.model.embed_tokens.logits(hidden) if self.lm_head is None else self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run all layers over the rows of a ragged batch, writing their K/V into the paged caches.

        Args:
            input_ids: [T] int64 token ids. positions: [T] int64 absolute positions.
            kv_caches: one (k_cache, v_cache) per layer, each
                [num_kv_blocks, kv_block_size, num_kv_heads, head_dim] (see allocate_kv_caches).
            meta: batch layout and cache slots for these rows.
            aux_layer_ids: decoder layers whose OUTPUT to return (HF `hidden_states[i + 1]` for
                i < num_layers - 1; for the last layer HF returns the final-normed state, we
                return the raw layer output).
        Returns:
            hidden [T, hidden] after the final norm; aux [T, len(aux_layer_ids) * hidden]
            (pre-final-norm residual stream, concatenated in the order of the ids) or None.
        Raises:
            ValueError: wrong number of KV caches, or an aux layer id outside [0, num_layers).
        """
        self._check_forward_args(kv_caches, aux_layer_ids)
        h = self.embed(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, h.dtype)
        captured: dict[int, torch.Tensor] = dict.fromkeys(aux_layer_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_caches[i], meta)
            if i in captured:
                captured[i] = h
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return self.model.norm(h), aux

    def _check_forward_args(self, kv_caches: list[KVCache], aux_layer_ids: tuple[int, ...]) -> None:
        n = self.config.num_hidden_layers
        if len(kv_caches) != n:
            raise ValueError(f"got {len(kv_caches)} KV caches, the model has {n} layers")
        bad = [i for i in aux_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} out of range: the model has layers 0..{n - 1}")

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict (safetensors, or a transformers GGUF conversion) into the model.

        `lm_head.weight` is ignored when the config ties embeddings (HF does the same); stale
        `rotary_emb.inv_freq` buffers are ignored. Tensors are cast to the model dtype. Packs
        the weights afterwards when the model was built with pack_weights.
        Raises:
            ValueError: missing / unexpected keys (first few, with counts), a shape mismatch, or
                weights already packed; the model is untouched when the key sets do not match.
        """
        self._check_not_packed()
        ignore = _IGNORED_KEYS + ((r"^lm_head\.weight$",) if self.lm_head is None else ())
        load_hf_state_dict(self, state_dict, ignore)
        self._maybe_pack()

    @torch.no_grad()
    def init_random_weights_(self, std: float = 0.02, seed: int = 0) -> None:
        """Fill weights with N(0, std) (norm weights 1, biases 0), then pack if configured.

        For tests and benchmarks. Raises ValueError if the weights are already packed.
        """
        self._check_not_packed()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        self._maybe_pack()

    def _check_not_packed(self) -> None:
        if self.packed:
            raise ValueError("weights are packed for CPU inference; build a new model to load weights again")

    def _maybe_pack(self) -> None:
        if not self.pack_weights:
            return
        for module in self.modules():
            if isinstance(module, (Linear, VocabEmbedding)):
                module.pack_()
        self.packed = True
