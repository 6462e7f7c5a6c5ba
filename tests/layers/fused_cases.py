"""Shared cases for the fused-op tests (CPU twins, the Triton interpreter, and CUDA).

Random target models on any device, a greedy / teacher-forced decode driver over the paged
cache, and an ulp distance for comparing low-precision results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import build_metadata
from blockdraft.bench.random_weights import fill_random_
from blockdraft.config import ModelConfig
from blockdraft.models import CausalLM, allocate_kv_caches, build_model
from tests.conftest import tiny_config


def random_target(
    config: ModelConfig | str = "llama", dtype=torch.float32, device="cpu", seed: int = 0, std: float = 0.08
) -> CausalLM:
    """A CausalLM (unpacked) with random weights drawn on `device`; config or a tiny_config arch name."""
    config = tiny_config(config, num_hidden_layers=2) if isinstance(config, str) else config
    model = build_model(config, dtype, device, pack_weights=False)
    fill_random_(model, std=std, seed=seed)
    return model


def cast_copy(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """The same weights in another dtype (a new model on the same device)."""
    other = build_model(model.config, dtype, next(model.parameters()).device, pack_weights=False)
    with torch.no_grad():
        for dst, src in zip(other.parameters(), model.parameters()):
            dst.copy_(src)
    return other


@dataclass
class DecodeRun:
    """tokens [R, steps + 1]: argmax after the prefill and after each decode step;
    logits [steps + 1, R, V] float32 of those positions; aux [all rows, k * H] or None."""

    tokens: torch.Tensor
    logits: torch.Tensor
    aux: torch.Tensor | None


@torch.inference_mode()
def decode(
    model: CausalLM,
    prompts: list[list[int]],
    steps: int,
    forced: torch.Tensor | None = None,
    aux_layer_ids: tuple[int, ...] = (),
    kv_block_size: int = 4,
) -> DecodeRun:
    """Prefill every prompt in one ragged forward, then `steps` one-row-per-request forwards.

    forced: [R, steps] tokens to feed at each decode step (teacher forcing); None = greedy.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    lens = [len(p) for p in prompts]
    tables, start = [], 0
    for n in lens:
        pages = -(-(n + steps) // kv_block_size)
        tables.append(list(range(start, start + pages)))
        start += pages
    caches = allocate_kv_caches(model.config, start, kv_block_size, dtype, device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    meta = build_metadata(lens, lens, tables, kv_block_size, device=device)
    hidden, aux = model(ids, positions, caches, meta, aux_layer_ids)
    last = torch.tensor(lens, device=device).cumsum(0) - 1
    logits, auxes = [model.compute_logits(hidden[last])], [aux]
    for step in range(steps):
        fed = logits[-1].argmax(-1) if forced is None else forced[:, step]
        seq_lens = [n + step + 1 for n in lens]
        meta = build_metadata(seq_lens, [1] * len(lens), tables, kv_block_size, device=device)
        positions = torch.tensor([n - 1 for n in seq_lens], device=device)
        hidden, aux = model(fed, positions, caches, meta, aux_layer_ids)
        logits.append(model.compute_logits(hidden))
        auxes.append(aux)
    stacked = torch.stack(logits)
    return DecodeRun(stacked.argmax(-1).T, stacked, torch.cat(auxes) if aux_layer_ids else None)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between same-dtype float tensors (int64)."""
    if a.dtype != b.dtype:
        raise ValueError(f"dtypes differ: {a.dtype} vs {b.dtype}")
    bits = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
            torch.float32: (torch.int32, 0x7FFFFFFF)}  # fmt: skip
    if a.dtype not in bits:
        raise ValueError(f"unsupported dtype {a.dtype}; supported: {list(bits)}")
    int_type, magnitude = bits[a.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(int_type).long()
        return torch.where(i < 0, -(i & magnitude), i)  # sign-magnitude -> monotone integers

    return (ordered(a) - ordered(b)).abs()
