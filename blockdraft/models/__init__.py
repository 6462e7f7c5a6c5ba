"""Target model architectures (Llama / Qwen2 / Qwen3 families) and their factory."""

from __future__ import annotations

import torch

from blockdraft.config import ModelConfig
from blockdraft.layers.attention import AttentionBackend
from blockdraft.models.kv_cache import allocate_kv_caches
from blockdraft.models.llama import CausalLM


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    transposed_weights: bool | None = None,
) -> CausalLM:
    """Allocate a CausalLM on `device` in `dtype`, in eval mode with requires_grad off.

    Parameters are allocated but NOT initialised (no slow random init of billions of weights):
    call `load_weights(state_dict)` or `init_random_weights_()` before use. The RoPE table is
    ready (float32).
    Args:
        backend: paged attention function; None = the torch reference (CPU path).
        transposed_weights: weight layout; None = [in, out] exactly for CPU float32, where MKL
            is much faster with it, HF's [out, in] otherwise (see blockdraft.layers.linear).
    """
    if transposed_weights is None:
        transposed_weights = torch.device(device).type == "cpu" and dtype == torch.float32
    kwargs = {"transposed_weights": transposed_weights} | ({"backend": backend} if backend is not None else {})
    with torch.device("meta"):
        model = CausalLM(config, **kwargs)
    # Cast on meta first so to_empty allocates each parameter once, directly in `dtype`.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.model.rotary_emb.reset_inv_freq()
    return model.requires_grad_(False).eval()


__all__ = ["CausalLM", "allocate_kv_caches", "build_model"]
