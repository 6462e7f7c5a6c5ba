"""Self-attention block for Llama / Qwen2 / Qwen3 layers: stacked qkv projection, optional per-head
q/k RMSNorm (Qwen3), RoPE, a pluggable paged-attention backend, output projection.

The backend is passed in (no module globals) so a GPU kernel can replace the torch reference
(`blockdraft.attention.torch_ref.paged_attention`) without touching the model code.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.attention.interface import AttentionBackend
from blockdraft.attention.metadata import AttentionMetadata
from blockdraft.layers.fused_ops import UsesFusedOps, qk_norm_rope, qk_norm_rope_write_kv
from blockdraft.layers.linear import Linear, StackedLinear
from blockdraft.layers.norm import RMSNorm


class Attention(UsesFusedOps, nn.Module):
    """GQA self-attention with HF-compatible parameter names (q/k/v live in `qkv_proj`).

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: shapes.
        qkv_bias: q/k/v projections carry a bias (Qwen2, or `attention_bias`).
        o_bias: the output projection carries a bias (Llama/Qwen3 with `attention_bias`).
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3), parameters `q_norm`, `k_norm`.
        rms_norm_eps: epsilon of the q/k norms.
        sliding_window: window (incl. self) for sliding-attention layers, None for full attention.
        backend: the paged attention function (see AttentionBackend).
        causal: passed to the backend; False only for non-causal draft blocks.
    Parameters are left uninitialised (weights are always loaded). On CUDA the q/k norm and
    RoPE run as one Triton kernel (`blockdraft.layers.fused_ops.qk_norm_rope`), which in causal
    layers also writes the forward's K/V into the paged cache when the backend accepts
    `kv_written` (`fused_ops.qk_norm_rope_write_kv`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        rms_norm_eps: float,
        sliding_window: int | None,
        backend: AttentionBackend,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.sliding_window, self.backend, self.causal = sliding_window, backend, causal
        shards = [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)]
        self.qkv_proj = StackedLinear(hidden_size, shards, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [rows, hidden] -> q [rows, heads, D], k [rows, kv_heads, D] (normed, rotated), v [rows, kv_heads, D].

        v is a view of the qkv matmul output; q and k are new tensors (normed and rotated).
        """
        q, k, v = self._split_heads(x)
        q, k = qk_norm_rope(q, k, cos, sin, *self._qk_norm_args(), self.fused_ops)
        return q, k, v

    def _split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [rows, hidden] -> views q [rows, heads, D], k, v [rows, kv_heads, D] of one qkv matmul."""
        rows = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(rows, self.num_heads, self.head_dim), k.view(rows, self.num_kv_heads, self.head_dim),
                v.view(rows, self.num_kv_heads, self.head_dim))  # fmt: skip

    def _qk_norm_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        if self.q_norm is None:
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [rows, hidden]; cos/sin [rows, 1, head_dim]; kv_cache = (k_cache, v_cache) -> [rows, hidden].

        Causal forwards (no draft block) through a backend that takes `kv_written` let the q/k
        norm + RoPE kernel write this forward's K/V into the cache in its launch (one launch less
        per layer); where the torch twins run, the backend writes as before.

        Raises:
            ValueError: the cache's page size differs from meta.kv_block_size (before any write).
        """
        written = False
        if (self.causal and not meta.num_block_tokens and getattr(self.backend, "accepts_kv_written", False)
                and meta.slot_mapping.device == x.device):  # fmt: skip
            if kv_cache[0].shape[1] != meta.kv_block_size:  # checked before the cache is written
                raise ValueError(f"cache pages hold {kv_cache[0].shape[1]} tokens but meta.kv_block_size is "
                                 f"{meta.kv_block_size}")  # fmt: skip
            q, k, v = self._split_heads(x)
            q, k, written = qk_norm_rope_write_kv(q, k, v, cos, sin, *self._qk_norm_args(), kv_cache,
                                                  meta.slot_mapping, self.fused_ops)  # fmt: skip
        else:
            q, k, v = self.project_qkv(x, cos, sin)
        extra = {"kv_written": True} if written else {}
        if self.batch_invariant and getattr(self.backend, "accepts_batch_invariant", False):
            extra["batch_invariant"] = True
        out = self.backend(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, sliding_window=self.sliding_window, causal=self.causal,
            **extra,
        )
        return self.o_proj(out.reshape(x.shape[0], self.q_size))
