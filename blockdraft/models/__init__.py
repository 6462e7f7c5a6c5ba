"""Target model architectures (Llama / Qwen2 / Qwen3 families) and their factory."""

from __future__ import annotations

import torch

from blockdraft.config import ModelConfig
from blockdraft.attention.interface import AttentionBackend
from blockdraft.layers.linear import cpu_packing_supported
from blockdraft.models.kv_cache import allocate_kv_caches
from blockdraft.models.llama import CausalLM


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    pack_weights: bool | None = None,
) -> CausalLM:
    """Allocate a CausalLM on `device` in `dtype`, in eval mode with requires_grad off.

    Parameters are allocated but NOT initialised (no slow random init of billions of weights):
    call `load_weights(state_dict)` or `init_random_weights_()` before use. The RoPE table is
    ready (float32).
    Args:
        backend: paged attention function; None = the torch reference (CPU path).
        pack_weights: pack matmul weights for oneDNN when they are loaded (inference-only, ~1.2-1.8x
            faster CPU matmuls, see blockdraft.layers.linear); None = whenever supported (CPU,
            fp32 / bf16). Pass False to train through the model or read its weights afterwards.
    """
    from blockdraft.cpu_threads import apply_pending_threads

    apply_pending_threads()  # a command's automatic thread choice, made after its flags were checked
    if pack_weights is None:
        pack_weights = cpu_packing_supported(dtype, device)
    kwargs = {"pack_weights": pack_weights} | ({"backend": backend} if backend is not None else {})
    with torch.device("meta"):
        model = CausalLM(config, **kwargs)
    # Cast on meta first so to_empty allocates each parameter once, directly in `dtype`.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.model.rotary_emb.reset_inv_freq()
    return model.requires_grad_(False).eval()


__all__ = ["CausalLM", "allocate_kv_caches", "build_model"]
