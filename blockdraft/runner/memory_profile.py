"""Size the GPU KV pool: profile a worst-case step's activation peak, then apply kv_budget.

The profile step (after the weights are loaded, before any KV pool exists) runs what the largest
step can run: the target over `max_num_batched_tokens` rows of one prompt, the LM head and a
top-p sampler over as many rows as a step can sample (min(tokens, max_num_seqs * Q)), and, with a
drafter, its context write for every row and one draft block per possible request. The caches
it needs are a few temporary pages, allocated before the baseline and freed afterwards. This
runs once at start-up and synchronises freely.
"""

from __future__ import annotations

import logging
import math

import torch

from blockdraft.attention.metadata import build_metadata
from blockdraft.models import allocate_kv_caches
from blockdraft.runner.kv_budget import kv_bytes_per_page, num_kv_blocks_from_memory
from blockdraft.sample.sampler import SamplingTensors
from blockdraft.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def num_kv_blocks_for_gpu(
    model,
    config,
    speculator,
    kv_block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    cuda_graphs: bool,
    device: torch.device,
    min_tokens: int | None = None,
    fp32_head: bool = False,
) -> int:
    """KV pages that fit on `device` (see blockdraft.runner.kv_budget for the formula).

    Args:
        model / config: the loaded target (CausalLM) and its ModelConfig.
        speculator: None or a DFlashSpeculator whose caches are not allocated yet.
        kv_block_size: tokens per KV page.
        max_num_batched_tokens / max_num_seqs: the largest step (rows / requests) the profile
            run makes, whose peak activation memory is kept free.
        gpu_memory_utilization: fraction of the device's memory the engine may use, in (0, 1].
        cuda_graphs: graphs will be captured (their pool doubles the activation reserve).
        device: the CUDA device the model is on (profiled and measured there).
        min_tokens: the pool must hold one request of this many tokens (max_model_len; None: the
            model's max_position_embeddings).
        fp32_head: the steps' LM head returns float32 logits (profiled so).
    Raises:
        ValueError: from num_kv_blocks_from_memory (utilization out of range, too little memory).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:  # fail before the profile run
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    activation = profile_activation_bytes(model, config, speculator, kv_block_size, max_num_batched_tokens, max_num_seqs,
                                          device, fp32_head)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    dtype_bytes = next(model.parameters()).dtype.itemsize
    target_layers = [(config.num_key_value_heads, config.head_dim)] * config.num_hidden_layers
    per_page = kv_bytes_per_page(kv_block_size, target_layers, dtype_bytes)
    if speculator is not None:
        per_page += speculator.kv_bytes_per_block()
    reserve = activation * (2 if cuda_graphs else 1)
    pages = num_kv_blocks_from_memory(
        total, total - free, reserve, per_page, gpu_memory_utilization, kv_block_size,
        config.max_position_embeddings if min_tokens is None else min_tokens,
    )
    logger.info(
        "KV pool: %d pages x %d tokens (%.2f GiB); activation reserve %.2f GiB",
        pages, kv_block_size, pages * per_page / (1 << 30), reserve / (1 << 30),
    )
    return pages


@torch.inference_mode()
def profile_activation_bytes(
    model, config, speculator, kv_block_size: int, max_num_batched_tokens: int, max_num_seqs: int, device,
    fp32_head: bool = False,
) -> int:
    """Peak bytes allocated above the baseline by one worst-case step (module docstring)."""
    rows = max_num_batched_tokens
    pages = math.ceil(rows / kv_block_size) + 1
    dtype = next(model.parameters()).dtype
    kv = allocate_kv_caches(config, pages, kv_block_size, dtype, device)
    draft_kv = speculator.drafter.allocate_kv_caches(pages, kv_block_size) if speculator is not None else None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    _profile_step(model, speculator, kv, draft_kv, rows, max_num_seqs, kv_block_size, pages, device, fp32_head)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, draft_kv
    return peak


def _profile_step(model, speculator, kv, draft_kv, rows, max_num_seqs, kv_block_size, pages, device,
                  fp32_head: bool = False) -> None:
    q = 1 if speculator is None else speculator.num_query_tokens
    aux_ids = () if speculator is None else tuple(speculator.aux_layer_ids)
    meta = build_metadata([rows], [rows], [list(range(pages))], kv_block_size, device=device)
    positions = torch.arange(rows, device=device)
    hidden, aux = model(torch.zeros(rows, dtype=torch.long, device=device), positions, kv, meta, aux_ids)
    num_logits = min(rows, max_num_seqs * q)
    logits = model.compute_logits(hidden[-num_logits:], upcast=False, fp32_head=fp32_head)  # as the runner's steps
    # top-p: the full-vocabulary sort, the sampler's largest temporaries; min-p too: every filter runs
    params = [SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=0)] * num_logits
    SamplingTensors.from_params(params, device).sample(logits, positions[-num_logits:] + 1)
    if speculator is None:
        return
    saved, speculator.kv_caches = speculator.kv_caches, draft_kv
    try:
        num_reqs = min(max_num_seqs, rows)
        table = torch.arange(pages, dtype=torch.int32, device=device).repeat(num_reqs, 1)
        bonus = torch.zeros(num_reqs, dtype=torch.long, device=device)
        bonus_positions = torch.full((num_reqs,), rows, dtype=torch.long, device=device)
        speculator.propose(aux, positions, meta.slot_mapping, bonus, bonus_positions, table)
    finally:
        speculator.kv_caches = saved
