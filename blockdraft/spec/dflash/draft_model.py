"""The DFlash draft model: Qwen3 decoder layers whose context K/V come from target features.

Math: DFLASH.md "Draft model" / "KV injection" / "Query block"; paper arXiv 2602.06036 Sec. 3;
z-lab `dflash/model.py` (`Qwen3DFlashAttention`, `DFlashDraftModel`). Context rows are not run
through the layers at all: each layer projects c_t = hidden_norm(fc(features_t)) straight into
its own K/V cache once (`write_context`). A draft block then runs as ordinary pre-norm layers
whose attention reads that cache plus the block's own K/V (`forward`), which is never cached.

KV cache layout (the target's): `kv_caches[l]` = (k_cache, v_cache) per draft layer, each
[num_kv_blocks, kv_block_size, num_kv_heads, head_dim], paged with the target's page ids.

Attention backend: the torch reference by default; `set_attention_backend` swaps in another
(blockdraft.attention.backends), the same way the engine sets the target's.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from blockdraft.attention.backends import AttentionBackendSpec, select_attention_backend
from blockdraft.attention.metadata import AttentionMetadata
from blockdraft.layers.fused_ops import (
    UsesFusedOps,
    linear,
    norm_rope,
    norm_rope_write_kv,
    qk_norm_rope,
    silu_mul,
    swiglu_mlp,
    use_kernels,
)
from blockdraft.layers.linear import Linear, cpu_packing_supported
from blockdraft.layers.norm import RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.spec.dflash.config import DFlashConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache)


def _stacked_usable(stacked: torch.Tensor | None, param: torch.Tensor) -> bool:
    """Whether a layer may multiply by its stacked weights (`DFlashDraftModel.stack_projections`):
    `param` is still a slice of them (a deepcopy or `load_state_dict(assign=True)` breaks that)
    and no gradient is asked for (the stacked copy is detached)."""
    return (stacked is not None and not (torch.is_grad_enabled() and param.requires_grad)
            and param.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr())  # fmt: skip


class DFlashAttention(UsesFusedOps, nn.Module):
    """Qwen3 attention (no biases, per-head q_norm/k_norm) with DFlash context injection.

    On CUDA the q/k norms and RoPE run as one Triton kernel (`blockdraft.layers.fused_ops`).
    """

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = Linear(h, self.num_heads * d, bias=False)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.scale = d**-0.5
        self.causal = config.layer_causal[layer_idx]
        self.sliding_window = config.layer_windows[layer_idx]
        self.backend = select_attention_backend("cpu").attention  # see DFlashDraftModel.set_attention_backend
        self.write_kv = select_attention_backend("cpu").write_kv
        self.qkv_weight: torch.Tensor | None = None  # [q; k; v] rows after `stack_`, else None

    def stack_(self) -> None:
        """Move q/k/v_proj's weights into one [q + 2 * kv, H] tensor (`qkv_weight`) whose row slices
        the three parameters become, so a block runs one q/k/v matmul and context rows one k/v
        matmul (its last 2 * kv rows); values, names and state_dict are unchanged."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        stacked = torch.cat([p.weight.detach() for p in projections])
        for p, rows in zip(projections, stacked.split([p.out_features for p in projections])):
            p.weight.data = rows
        self.qkv_weight = stacked

    def _project(self, x: torch.Tensor, with_q: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (q [T, heads, D] or None, k, v [T, kv_heads, D]); views of one matmul when stacked."""
        rows, q_size, kv_size = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if _stacked_usable(self.qkv_weight, self.k_proj.weight):
            weight = self.qkv_weight if with_q else self.qkv_weight[q_size:]
            out = linear(x, weight, None, self.q_proj.fused_ops)
            q, k, v = out.split([q_size, kv_size, kv_size], dim=-1) if with_q else (None, *out.split(kv_size, dim=-1))
        else:
            q = self.q_proj(x) if with_q else None
            k, v = self.k_proj(x), self.v_proj(x)
        q = None if q is None else q.view(rows, self.num_heads, self.head_dim)
        return q, k.view(rows, self.num_kv_heads, self.head_dim), v.view(rows, self.num_kv_heads, self.head_dim)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [T, H] (already hidden_norm(fc(.))) -> K = RoPE(k_norm(W_k c)), V = W_v c, each [T, kv_heads, D].

        No input_layernorm on c and no norm on V (DFLASH.md "KV injection"; z-lab applies k_norm
        to the concatenated [context, block] keys and leaves values raw).
        """
        _, k, v = self._project(c, with_q=False)
        return norm_rope(k, cos, sin, self.k_norm.weight, self.k_norm.eps, self.fused_ops), v

    def write_context(
        self,
        c: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        projected: torch.Tensor | None = None,
    ) -> None:
        """Cache `context_kv(c)` at slot_mapping (PADDING_SLOT rows write nothing). Where the kernels
        run, the k norm + RoPE launch writes K and V itself (one launch less per layer); else the
        attention backend's write_kv does. projected: [T, 2 * kv_heads * D] = c @ [W_k; W_v].T
        computed already (`DFlashDraftModel.write_context`: every layer's in one matmul), a view
        with any row stride."""
        if projected is None:
            _, k, v = self._project(c, with_q=False)
        else:
            k, v = (t.view(c.shape[0], self.num_kv_heads, self.head_dim) for t in projected.chunk(2, dim=-1))
        k, written = norm_rope_write_kv(k, v, cos, sin, self.k_norm.weight, self.k_norm.eps, kv_cache, slot_mapping,
                                        self.fused_ops)  # fmt: skip
        if not written:
            self.write_kv(kv_cache[0], kv_cache[1], k, v, slot_mapping)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Block rows x [R*Q, H] attend to their cached context and their own block -> [R*Q, H]."""
        q, k, v = self._project(x, with_q=True)
        q_w, k_w = self.q_norm.weight, self.k_norm.weight
        q, k = qk_norm_rope(q, k, cos, sin, q_w, k_w, self.q_norm.eps, self.fused_ops)
        k_cache, v_cache = kv_cache
        out = self.backend(
            q, k, v, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window, causal=self.causal
        )
        return self.o_proj(out.reshape(x.shape[0], -1))


class DFlashMLP(UsesFusedOps, nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases (HF Qwen3MLP); silu * up is one kernel on CUDA.

    After `stack_` the gate and up weights live in one [2I, H] tensor and the MLP runs as the
    target's does (`blockdraft.layers.fused_ops.swiglu_mlp`: for 2-16 rows the gate/up matmul and
    the activation in one launch).
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [gate; up] rows after `stack_`, else None

    def stack_(self) -> None:
        """Move gate/up_proj's weights into one [2I, H] tensor whose halves the parameters become."""
        stacked = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        self.gate_proj.weight.data, self.up_proj.weight.data = stacked.chunk(2)
        self.gate_up_weight = stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (_stacked_usable(self.gate_up_weight, self.up_proj.weight) and self.fused_ops
                and self.down_proj.packed_weight is None):  # fmt: skip
            return swiglu_mlp(x, self.gate_up_weight, self.down_proj.weight, self.down_proj.fused_ops)
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x), self.fused_ops))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only the block rows go through it (context is injected as K/V).

    `forward_with_residual` is the same layer with the residual stream carried apart, so both
    residual adds fuse into the next RMSNorm (CUDA path; see `blockdraft.models.llama.DecoderLayer`).
    """

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_with_residual(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the block embeddings when residual is None);
        returns (mlp_out, residual) whose sum is what `forward` returns. All [R*Q, H]."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta), residual)
        return self.mlp(h), residual


class DFlashDraftModel(UsesFusedOps, nn.Module):
    """DFlash drafter. Parameter names match the z-lab checkpoint exactly (DFLASH.md "Checkpoint format").

    It has no embedding and no LM head: callers embed with the target (times
    `config.input_embedding_scale`) and score with `compute_logits(hidden, target_lm_head)`.
    CUDA forwards use the Triton kernels of `blockdraft.layers.fused_ops` (norms, q/k norm +
    RoPE, SwiGLU, residual adds fused into the norms); CPU forwards run the torch code.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = Linear(config.num_aux_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          max_positions=config.max_position_embeddings)
        self.attention_backend = select_attention_backend("cpu")
        # every layer's [W_k; W_v] rows in one [L * 2 * kv, H] copy (`stack_projections`), else None
        self.context_kv_weight: torch.Tensor | None = None
        self._context_kv_versions: tuple[int, ...] = ()

    def set_attention_backend(self, backend: AttentionBackendSpec) -> None:
        """Use `backend` for the block attention and the context K/V writes of every layer."""
        self.attention_backend = backend
        for layer in self.layers:
            layer.self_attn.backend, layer.self_attn.write_kv = backend.attention, backend.write_kv

    def _apply(self, fn, recurse: bool = True):
        # A dtype cast (model.to(bfloat16)) also casts the non-persistent inv_freq buffer; HF and
        # the target keep it in float32, so recompute it after every .to()/.cuda()/.half().
        super()._apply(fn, recurse)
        self.rotary_emb.reset_inv_freq()
        # the parameters are new tensors now, no longer views of the stacked ones
        for layer in getattr(self, "layers", ()):
            layer.self_attn.qkv_weight = layer.mlp.gate_up_weight = None
        self.context_kv_weight = None
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # a norm: the linears' dense weights are dropped when packed

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def packed(self) -> bool:
        """Whether `pack_for_cpu_inference` replaced the linears' dense weights."""
        return self.fc.packed_weight is not None

    @property
    def stacked(self) -> bool:
        """Whether `stack_projections` holds each layer's q/k/v and gate/up weights in one tensor each."""
        return bool(self.layers) and self.layers[0].self_attn.qkv_weight is not None

    def stack_projections(self) -> bool:
        """Hold each layer's q/k/v weights in one tensor and its gate/up weights in another, the
        parameters becoming row slices of them (names, values and state_dict unchanged), so a draft
        block runs 4 matmul launches per layer instead of 7 and context rows 1 instead of 2 (the
        target's layers are stacked the same way). For inference on CUDA (DFlashSpeculator does it
        there); a later .to() / dtype cast undoes it. Returns False (nothing changed) when the
        weights are packed for the CPU or already stacked."""
        if self.packed or self.stacked:
            return False
        for layer in self.layers:
            layer.self_attn.stack_()
            layer.mlp.stack_()
        self._stack_context_kv()
        return True

    def _stack_context_kv(self) -> None:
        """Copy every stacked layer's k/v rows into `context_kv_weight` [L * 2 * kv, H], so the
        context rows of all layers take one matmul (`write_context`; 4 launches fewer per step for
        a 5-layer drafter). A copy, not views: each layer's q/k/v rows must stay one tensor for
        the block's matmul; `load_weights` refreshes it."""
        attns = [layer.self_attn for layer in self.layers]
        if not attns or any(a.qkv_weight is None for a in attns):
            self.context_kv_weight = None
            return
        q_size = attns[0].num_heads * attns[0].head_dim
        stacked = torch.cat([a.qkv_weight[q_size:] for a in attns])
        if self.context_kv_weight is not None and self.context_kv_weight.shape == stacked.shape:
            self.context_kv_weight.copy_(stacked)  # in place: captured CUDA graphs read this address
        else:
            self.context_kv_weight = stacked
        self._context_kv_versions = self._kv_versions()

    def _kv_versions(self) -> tuple[int, ...]:
        """The k/v parameters' in-place version counters: any copy into them, optimizer step or
        load_state_dict after `_stack_context_kv` changes one, and the copy is stale."""
        return tuple(p._version for layer in self.layers for p in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight))

    def _usable_context_kv_weight(self) -> torch.Tensor | None:
        """`context_kv_weight` while it still equals the layers' k/v weights (else None: the
        per-layer matmuls, always current)."""
        if self.context_kv_weight is None or self._context_kv_versions != self._kv_versions():
            return None
        if not all(_stacked_usable(layer.self_attn.qkv_weight, layer.self_attn.k_proj.weight) for layer in self.layers):
            return None
        return self.context_kv_weight

    def pack_for_cpu_inference(self) -> bool:
        """Store every linear's weight in oneDNN's blocked layout (blockdraft.layers.linear), as the
        target's are on the CPU: the drafter's matmuls were ~8 % of a K = 2 DFlash run's CPU time
        there, unpacked. Inference only: the dense weights are dropped, so the model can no longer
        be trained, exported or moved. Returns False (nothing changed) where packing is not
        supported (not the CPU, a dtype oneDNN does not pack, or packed already)."""
        if self.packed or not cpu_packing_supported(self.dtype, self.device):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_()
        for layer in self.layers:  # the packed copies replace the dense (stacked) weights
            layer.self_attn.qkv_weight = layer.mlp.gate_up_weight = None
        self.context_kv_weight = None
        return True

    def allocate_kv_caches(
        self, num_kv_blocks: int, kv_block_size: int, dtype: torch.dtype | None = None, device=None
    ) -> list[KVCache]:
        """Zeroed paged caches: per layer (k_cache, v_cache), each [num_kv_blocks, kv_block_size,
        kv_heads, head_dim] (the target's layout). dtype/device default to the model's. Page ids
        are the target's (same block_table / slot_mapping)."""
        cfg = self.config
        shape = (num_kv_blocks, kv_block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype, device = dtype or self.dtype, device or self.device
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in self.layers
        ]

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, n*H] (target hidden states at target_layer_ids, concatenated) -> c [T, H]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    @torch.no_grad()
    def write_context(
        self, features: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], slot_mapping: torch.Tensor
    ) -> None:
        """Cache every draft layer's context K/V for committed target rows.

        Args:
            features: [T, n*H] target features (any float dtype; cast to the model's).
            positions: [T] int positions of the rows (RoPE).
            kv_caches: from `allocate_kv_caches`; written in place.
            slot_mapping: [T] int64 cache slots; PADDING_SLOT rows (rejected drafts, padding) write
                nothing, so callers keep T static.
        """
        c = self.project_context(features)
        cos, sin = self.rotary_emb.cos_sin(positions, self.dtype)
        projected, weight = None, self._usable_context_kv_weight()
        if weight is not None:  # every layer's context K/V in one matmul
            projected = linear(c, weight, None, self.fc.fused_ops).chunk(len(self.layers), dim=-1)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer.self_attn.write_context(c, cos, sin, kv_cache, slot_mapping, None if projected is None else projected[i])

    @torch.no_grad()
    def forward(
        self, block_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run draft blocks. Returns the final-normed hidden states [R*Q, H] in the model dtype.

        Args:
            block_embeds: [R*Q, H] target embeddings of [anchor, MASK x (Q-1)] per request (already
                times input_embedding_scale).
            positions: [R*Q] P..P+Q-1 per request, P = meta.seq_lens (context = positions < P).
            kv_caches: the draft caches holding every context position < P.
            meta: block-mode metadata: num_block_tokens == Q, slot_mapping all PADDING_SLOT.
        Raises:
            ValueError: meta is not block-mode metadata.
        """
        if meta.num_block_tokens < 1:
            raise ValueError("DFlashDraftModel.forward needs block-mode metadata (meta.num_block_tokens > 0)")
        x = block_embeds.to(self.dtype)
        cos, sin = self.rotary_emb.cos_sin(positions, self.dtype)
        if use_kernels(self.fused_ops, x):
            residual = None
            for layer, kv in zip(self.layers, kv_caches):
                x, residual = layer.forward_with_residual(x, residual, cos, sin, kv, meta)
            return self.norm(x, residual)[0]
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    def compute_logits(
        self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], upcast: bool = True
    ) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 via the TARGET's LM head (z-lab `compute_logits`).

        logits = lm_head(hidden) * output_multiplier, then tanh(x / c) * c when softcapping c is set.
        upcast=False (callers that only take the argmax): when neither transform applies, the head's
        output is returned in its own dtype, skipping a float32 copy of [N, V]; its argmax is the same.
        """
        cfg = self.config
        if not upcast and cfg.output_multiplier == 1.0 and cfg.final_logit_softcapping is None:
            return lm_head(hidden)
        logits = lm_head(hidden).float()
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            c = cfg.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint state dict in (cast to the model's dtype/device).

        Raises:
            ValueError: listing missing keys, unexpected keys, and shape mismatches.
        """
        params = self.state_dict()
        missing = sorted(set(params) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(params))
        shapes = sorted(
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(params[k].shape)}"
            for k in set(params) & set(state_dict)
            if tuple(state_dict[k].shape) != tuple(params[k].shape)
        )
        if missing or unexpected or shapes:
            raise ValueError(
                f"DFlash drafter weights do not match the config: missing keys {missing}, "
                f"unexpected keys {unexpected}, shape mismatches {shapes}"
            )
        for name, tensor in state_dict.items():
            params[name].copy_(tensor)
        if self.context_kv_weight is not None:
            self._stack_context_kv()
