"""The one place that picks the paged-attention backend for a device (target and drafter alike).

Backends:
  "torch"  - `torch_ref.paged_attention`: the CPU path and test oracle; loops over requests in
             Python and needs the host copies of the metadata (query_start_loc_host, seq_lens_host).
  "dense"  - `dense_ref.paged_attention_dense`: vectorised torch twin of the GPU kernels; reads
             device metadata only, so it is sync-free and CUDA-graph capturable (any device).
  "triton" - `triton_attention.paged_attention_triton`: the GPU kernels (CUDA only).
Default: "torch" on CPU; on CUDA "triton" when Triton imports, else "dense".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from blockdraft.attention.interface import AttentionBackend

# (k_cache, v_cache, k [rows, kv_heads, D], v, slot_mapping [rows] int64) -> None; skips PADDING_SLOT.
KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

BACKEND_NAMES = ("torch", "dense", "triton")


@dataclass(frozen=True)
class AttentionBackendSpec:
    """A paged-attention backend and its companion cache writer.

    name: one of BACKEND_NAMES. attention: the AttentionBackend function (writes causal K/V, attends).
    write_kv: scatters rows into a paged cache (the drafter's context injection uses it directly).
    host_metadata: the backend reads `query_start_loc_host` / `seq_lens_host`; when False the
        runner leaves them None and nothing in a step reads device values back to the host.
    """

    name: str
    attention: AttentionBackend
    write_kv: KVWriter
    host_metadata: bool


def select_attention_backend(device: str | torch.device, name: str | None = None) -> AttentionBackendSpec:
    """The backend for `device`: `name` if given, else the device's default (module docstring).

    Raises:
        ValueError: unknown name, or "triton" on a non-CUDA device.
        ImportError: "triton" asked for explicitly but Triton (or the kernel module) is missing.
    """
    device = torch.device(device)
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {list(BACKEND_NAMES)}, got {name!r}")
    if name is None:
        name = "torch" if device.type != "cuda" else ("triton" if _triton_available() else "dense")
    if name == "torch":
        from blockdraft.attention.torch_ref import paged_attention, write_kv

        return AttentionBackendSpec("torch", paged_attention, write_kv, host_metadata=True)
    if name == "dense":
        from blockdraft.attention.dense_ref import paged_attention_dense, write_kv_dense

        return AttentionBackendSpec("dense", paged_attention_dense, write_kv_dense, host_metadata=False)
    if device.type != "cuda":
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device}")
    from blockdraft.attention.triton_attention import paged_attention_triton, write_kv_triton

    return AttentionBackendSpec("triton", paged_attention_triton, write_kv_triton, host_metadata=False)


def _triton_available() -> bool:
    try:
        import blockdraft.attention.triton_attention  # noqa: F401  (imports triton)
    except ImportError:
        return False
    return True
