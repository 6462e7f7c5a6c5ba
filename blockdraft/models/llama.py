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
from blockdraft.attention.interface import AttentionBackend
from blockdraft.layers.attention import Attention
from blockdraft.layers.embedding import VocabEmbedding
from blockdraft.layers.fused_ops import UsesFusedOps, use_kernels
from blockdraft.layers.fused_ops import argmax as fused_argmax
from blockdraft.layers.linear import Linear, load_hf_state_dict
from blockdraft.layers.mlp import GatedMLP
from blockdraft.layers.norm import RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding

# Checkpoint entries that carry no weights we need (old HF checkpoints saved the RoPE buffer).
_IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)). [rows, hidden] -> [rows, hidden].

    `forward` returns the residual stream (CPU path); `forward_with_residual` carries the stream
    separately so both residual adds fuse into the next RMSNorm (CUDA path, vLLM's pattern).
    """

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

    def forward_with_residual(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block with the residual stream carried apart: stream = h + residual.

        Args:
            h: [rows, hidden] the previous layer's MLP output, or the embeddings when residual is None.
            residual: [rows, hidden] the stream before the previous MLP, or None for the first layer.
        Returns:
            (mlp_out, residual) whose sum is this layer's output stream (what `forward` returns).
        """
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """HF's `model.` submodule: embed_tokens, layers, norm (and the shared rotary table)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          max_positions=config.max_position_embeddings)


class CausalLM(UsesFusedOps, nn.Module):
    """Target model for the engine (and the embedding / LM head the DFlash drafter borrows).

    Parameter names are HF's except the stacked `qkv_proj` / `gate_up_proj`; `load_weights`
    takes an HF state dict. Build with `blockdraft.models.build_model`.

    Args:
        config: the normalised architecture.
        backend: paged attention function (default: the torch reference, CPU path).
        pack_weights: after loading, pack the matmul weights for oneDNN (CPU fp32 / bf16 only;
            inference-only; see blockdraft.layers.linear).
    Parameters are left uninitialised: use build_model, then load_weights. CUDA forwards use
    the Triton kernels of `blockdraft.layers.fused_ops` (`set_fused_ops(model, False)` turns
    them off); CPU forwards run the torch code.
    """

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend = paged_attention, pack_weights: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.pack_weights = pack_weights
        self.packed = False
        self.model = DecoderStack(config, backend)
        self.attention_backend = backend  # the function every layer attends with (set_attention_backend)
        # Tied: compute_logits uses embed_tokens (no second parameter).
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Use the paged attention function `backend` in every layer (see blockdraft.attention.backends)."""
        self.attention_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden] in the model dtype."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        out: torch.Tensor | None = None,
        upcast: bool = True,
        fp32_head: bool = False,
        invariant: bool | None = None,
    ) -> torch.Tensor:
        """hidden [N, hidden] (after the final norm) -> logits [N, vocab] float32 (upcast=True), the
        head's dtype (upcast=False), or `out`.

        fp32_head (CUDA, bf16 / fp16 weights; vLLM's and SGLang's --enable-fp32-lm-head): the head's
        matmul returns its float32 accumulation instead of rounding it to the weight dtype
        (torch.mm out_dtype): the same operands, but logits that differ by less than one bf16 step
        (0.125 at |logit| in [16, 32)) no longer tie, so greedy choices do not hinge on the
        rounding. Returns float32 whatever `upcast`; `out` must then be float32. A no-op for
        float32 weights.

        Pass only the rows you need (e.g. the last row of each prompt): the LM head is the
        largest matmul of a decode step. `out` ([N, vocab]): write there instead of a new tensor
        (CUDA graphs keep one logits buffer for every bucket). When `out` has the head weight's
        dtype the matmul writes into it directly: no float32 copy, which at 512 verify rows x
        152K ids is ~0.3 GB of traffic per step; consumers upcast what they read (sampling,
        logprobs), and argmax of bf16 logits equals argmax of their exact float32 cast.
        upcast=False (no `out`): the head's output in its own dtype, no float32 copy, for callers
        that take the argmax or upcast what they read themselves (the runner's eager steps: sampling
        and logprobs upcast; the DFlash drafter's full-vocabulary proposals).
        invariant: None = the model's batch-invariant mode (`self.batch_invariant`); False keeps the
        fast head for this call (the DFlash drafter's proposals: drafts need no invariance). In
        that mode (CUDA, dense head) the head's matmul is
        `blockdraft.kernels.invariant_gemm.invariant_linear` (float32 out with fp32_head), so a row's
        logits do not depend on the other rows; dtypes and `out` as above.
        Raises:
            ValueError: fp32_head for bf16 / fp16 weights off CUDA; in batch-invariant mode, hidden
                states of another dtype than the head's, or a call that records autograd (the
                kernel has no backward).
        """
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        weight = head.weight
        if (self.batch_invariant if invariant is None else invariant) and hidden.is_cuda and weight is not None:
            return self._invariant_logits(hidden, weight, out, upcast, fp32_head)
        if fp32_head and hidden.dtype != torch.float32:
            if hidden.device.type != "cuda":
                raise ValueError(f"fp32_head needs CUDA (torch.mm out_dtype), the hidden states are on {hidden.device}")
            if weight is None:  # only CPU heads are packed for oneDNN, but say so if one gets here
                raise ValueError("fp32_head needs the LM head's dense weight, and this head was packed (pack_weights)")
            if out is None:
                return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
        if out is not None and weight is not None and out.dtype == weight.dtype and hidden.dtype == weight.dtype:
            return torch.mm(hidden, weight.t(), out=out)  # the LM heads have no bias
        logits = head.logits(hidden) if self.lm_head is None else head(hidden)
        if out is not None:
            return out.copy_(logits)
        return logits.float() if upcast else logits

    def _invariant_logits(self, hidden, weight, out, upcast: bool, fp32_head: bool) -> torch.Tensor:
        """`compute_logits` in batch-invariant mode (same contract)."""
        from blockdraft.kernels.invariant_gemm import invariant_linear

        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            raise ValueError("the batch-invariant LM head has no backward: call compute_logits under "
                             "torch.no_grad() / inference_mode, or with invariant=False")

        dtype = torch.float32 if fp32_head else weight.dtype
        if out is not None and out.dtype == dtype:
            return invariant_linear(hidden, weight, None, out_dtype=dtype, out=out)
        logits = invariant_linear(hidden, weight, None, out_dtype=dtype)
        if out is not None:
            return out.copy_(logits)
        return logits.float() if upcast else logits

    def greedy_tokens(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy ids of logits [N, V] -> [N] int64 (into `out` [N] when given), == torch.argmax(
        logits, -1) with ties to the lowest id. On CUDA with the model's fused ops on, two short
        launches instead of one block per row (blockdraft.kernels.argmax)."""
        return fused_argmax(logits, self.model.norm.fused_ops, out)

    @torch.no_grad()
    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The LM-head rows of `token_ids` [N] -> a new [N, hidden] tensor in the model dtype/device.

        Row i scores token token_ids[i] exactly as `compute_logits` does (tied models: the
        embedding rows). For a draft vocabulary (blockdraft.spec.draft_vocab.DraftHead). When the
        untied head was packed for oneDNN (its dense weight is dropped), the rows are read back
        through the packed matmul with identity inputs (exact: each output is one weight times 1).
        Raises:
            ValueError: token_ids not 1-D, or an id outside [0, vocab_size).
        """
        vocab = self.config.vocab_size
        if token_ids.dim() != 1 or (token_ids.numel() and not (0 <= int(token_ids.min()) and int(token_ids.max()) < vocab)):
            raise ValueError(f"token_ids must be a 1-D tensor of ids in [0, {vocab}), got shape "
                             f"{list(token_ids.shape)} with ids outside that range")
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if head is not None:
            return head.index_select(0, token_ids.to(head.device)).clone()
        ids = token_ids.to(self.lm_head.packed_weight.device)
        h = self.config.hidden_size
        rows = torch.empty(ids.numel(), h, dtype=self.embed_tokens_dtype, device=ids.device)
        eye = torch.eye(h, dtype=rows.dtype, device=ids.device)
        for start in range(0, h, 256):  # [256, V] at a time, not a [H, V] transpose of the head
            block = self.lm_head(eye[start : start + 256])  # [b, V] = W[:, start:start+b].T
            rows[:, start : start + block.shape[0]] = block.index_select(1, ids).T
        return rows

    @property
    def embed_tokens_dtype(self) -> torch.dtype:
        """The dtype of the weights (the embedding table is never packed away)."""
        return self.model.embed_tokens.weight.dtype

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
        run = self._run_layers_fused if use_kernels(self.fused_ops, h) else self._run_layers
        hidden, captured = run(h, cos, sin, kv_caches, meta, set(aux_layer_ids))
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return hidden, aux

    def _run_layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        aux_ids: set[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """All layers and the final norm; returns (hidden, {layer id: output stream} for aux_ids)."""
        captured = {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_caches[i], meta)
            if i in aux_ids:
                captured[i] = h
        return self.model.norm(h), captured

    def _run_layers_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        aux_ids: set[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`_run_layers` with the residual carried between layers (two fused add+norms per layer)."""
        captured = {}
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer.forward_with_residual(h, residual, cos, sin, kv_caches[i], meta)
            if i in aux_ids:
                # The stream after layer i: the same rounded sum the next fused add+norm computes.
                captured[i] = h + residual
        return self.model.norm(h, residual)[0], captured

    def _check_forward_args(self, kv_caches: list[KVCache], aux_layer_ids: tuple[int, ...]) -> None:
        n = self.config.num_hidden_layers
        if len(kv_caches) != n:
            raise ValueError(f"got {len(kv_caches)} KV caches, the model has {n} layers")
        bad = [i for i in aux_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} out of range: the model has layers 0..{n - 1}")

    def load_weights(self, state_dict: dict[str, torch.Tensor], pack: bool = True) -> None:
        """Copy an HF-named state dict (safetensors, or a transformers GGUF conversion) into the model.

        `lm_head.weight` is ignored when the config ties embeddings (HF does the same); stale
        `rotary_emb.inv_freq` buffers are ignored. Tensors are cast to the model dtype. Packs
        the weights afterwards when the model was built with pack_weights, unless `pack` is False:
        then call `pack_loaded_weights()` once the caller has dropped `state_dict`, so the state
        dict, the dense weights and their packed copies are never all in memory at once.
        Raises:
            ValueError: missing / unexpected keys (first few, with counts), a shape mismatch, or
                weights already packed; the model is untouched when the key sets do not match.
        """
        self._check_not_packed()
        ignore = _IGNORED_KEYS + ((r"^lm_head\.weight$",) if self.lm_head is None else ())
        load_hf_state_dict(self, state_dict, ignore)
        if pack:
            self._maybe_pack()

    def pack_loaded_weights(self) -> None:
        """Pack the weights for CPU inference when the model was built with pack_weights (after
        `load_weights(..., pack=False)`). Raises ValueError if they are packed already."""
        self._check_not_packed()
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
