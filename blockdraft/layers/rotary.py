"""Rotary position embedding (RoPE, Su et al. 2021) in the HF "rotate_half" layout.

Supported `rope_scaling` / `rope_parameters` types: default, linear, llama3 (formula from Meta's
Llama 3.1 reference, as in HF `_compute_llama3_parameters`). Anything else is refused.

The inverse frequencies are computed in float32 exactly like HF `modeling_rope_utils` (not in
float64) so that our angles are bit-identical to the transformers oracle.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for the given theta and scaling dict.

    Raises:
        ValueError: unknown rope type (names the type and the supported ones).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (float(theta) ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv = inv / float(scaling["factor"])
    elif rope_type == "llama3":
        inv = _llama3_scale(inv, scaling)
    else:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return inv.float()


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


# Positions a table covers past max_positions: a DFlash draft block (block_size - 1 rows) may run
# past the last position the engine admits.
TABLE_MARGIN = 256


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [rows, heads, head_dim] and k [rows, kv_heads, head_dim] at `positions` [rows].

    Models compute `cos_sin(positions, dtype)` once per forward and call `apply_rotary` in every
    layer (all layers share the table), instead of calling `forward` per layer.

    With `max_positions`, CUDA calls gather cos / sin from a table of every position 0 ..
    max_positions + TABLE_MARGIN - 1 built once per (dtype, device) by the same float32 ops
    (2 launches per call instead of 7: a small-batch GPU step is launch-bound; [N, 2, head_dim]
    in `dtype`, e.g. 21 MB for Qwen3-8B's 40,960 positions in bf16). Positions outside the table
    are clamped into it. CPU calls compute the angles as before.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None, max_positions: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def reset_inv_freq(self) -> None:
        """Recompute `inv_freq` in float32 (after `to_empty()` or a dtype cast clobbered it)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)
        self._tables.clear()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [rows] int -> (cos, sin), each [rows, 1, head_dim] in `dtype` (views of one
        [rows, 2, head_dim] gather where the table is used).

        Angles are computed in float32 and then cast, like HF's rotary embedding.
        """
        table = self._table(dtype, positions.device) if positions.is_cuda else None
        if table is not None:
            both = table[positions.clamp(0, table.shape[0] - 1)]
            return both[:, 0:1], both[:, 1:2]
        return self._angles_cos_sin(positions, dtype)

    def _angles_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _table(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The [N, 2, head_dim] cos / sin table for (dtype, device), built on first use; None
        without max_positions, or when first asked for inside a CUDA-graph capture (building it
        there would record it into the graph)."""
        if self.max_positions is None:
            return None
        table = self._tables.get((dtype, device))
        if table is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            positions = torch.arange(self.max_positions + TABLE_MARGIN, device=device)
            cos, sin = self._angles_cos_sin(positions, dtype)
            table = self._tables[(dtype, device)] = torch.cat([cos, sin], dim=1)
        return table

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] -> x * cos + rotate_half(x) * sin, in x's dtype (as HF).

    cos, sin: [rows, 1, head_dim] from `RotaryEmbedding.cos_sin` (same dtype as x).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
