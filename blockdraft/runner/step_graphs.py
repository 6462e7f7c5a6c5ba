"""Builds the graphs of uniform steps, per bucket: the target (forward + LM head + greedy argmax)
and the step's tail (verify, the drafter step with a DFlash speculator, pack; runner.step_tail).

Capture order is largest bucket first, target, tail and continuation of each bucket, all in one
memory pool: the largest graph sizes the pool and the smaller ones reuse it.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockdraft.runner.continuation import ContinuationGraphs
from blockdraft.runner.cuda_graphs import TargetGraphs, capture_sizes
from blockdraft.runner.prefill_graphs import PrefillGraphs, prefill_request_sizes, prefill_sizes
from blockdraft.runner.step_tail import StepTailGraphs

if TYPE_CHECKING:
    from blockdraft.spec.dflash.cuda_graph import DraftStep

logger = logging.getLogger(__name__)


@dataclass
class StepGraphs:
    """The target graphs, the tail graphs of the same buckets, the continuation graphs (async
    scheduling's next step; None when async scheduling is off) and the prefill graphs of up to
    PREFILL_MAX_REQUESTS requests (None when no prefill bucket fits max_num_batched_tokens)."""

    target: TargetGraphs
    tail: StepTailGraphs
    continuation: ContinuationGraphs | None
    prefill: PrefillGraphs | None = None

    @property
    def draft(self) -> DraftStep | None:
        """The drafter step the tails run (None for plain decoding)."""
        return self.tail.draft_step


def build_step_graphs(
    model,
    kv_caches,
    speculator,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_table_width: int,
    kv_block_size: int,
    capture: bool,
    continuation: bool = True,
    fp32_head: bool = False,
) -> StepGraphs | None:
    """Capture (or, capture=False, prepare to run eagerly) the uniform-step and prefill graphs.

    Args:
        model: the target CausalLM the graphs run.
        kv_caches: its paged caches (allocate_kv_caches: per layer a (k, v) pair of
            [num_kv_blocks, kv_block_size, num_kv_heads, head_dim]), written in place.
        speculator: None (plain decoding: Q = 1) or a DFlashSpeculator (Q = K + 1).
        max_num_seqs: the most requests in a step: caps the request buckets.
        max_num_batched_tokens: the most rows in a step: caps the request buckets at
            max_num_batched_tokens // Q and the prefill row buckets.
        block_table_width: pages per request the static block table holds
            (ceil(max_model_len / kv_block_size)).
        kv_block_size: tokens per KV page.
        capture: True on CUDA; False runs the identical padded static-shape code eagerly.
        continuation: also build async scheduling's continuation graphs (capture time and pool
            memory are spent only when the engine can use them).
        fp32_head: the LM head returns float32 logits (CausalLM.compute_logits fp32_head).
    Returns:
        None when no bucket fits (max_num_batched_tokens < Q) or the speculator is not a
        DFlashSpeculator (other speculators run eagerly).
    """
    from blockdraft.spec.dflash.cuda_graph import DraftStep, draft_after_prefill
    from blockdraft.spec.dflash.prepare_inputs import draft_input_preparer
    from blockdraft.spec.dflash.speculator import DFlashSpeculator

    if speculator is not None and not isinstance(speculator, DFlashSpeculator):
        return None
    rows_per_req = 1 if speculator is None else speculator.num_query_tokens
    buckets = capture_sizes(max_num_seqs, max_num_batched_tokens, rows_per_req)
    if not buckets:
        return None
    aux_layer_ids = () if speculator is None else speculator.aux_layer_ids
    pool = torch.cuda.graph_pool_handle() if capture else None
    # Start-up cost, logged below: capture seconds and the pool's reserved memory.
    started = time.perf_counter()
    reserved_before = torch.cuda.memory_reserved() if capture else 0
    target = TargetGraphs(
        model, kv_caches, aux_layer_ids, buckets, rows_per_req, block_table_width, kv_block_size, capture, pool,
        fp32_head=fp32_head,
    )
    draft = None if speculator is None else DraftStep(speculator, target)
    tail = StepTailGraphs(target, draft, capture, pool)
    cont = ContinuationGraphs(target.inputs, rows_per_req, kv_block_size, capture, pool) if continuation else None
    for num_reqs in reversed(buckets):
        target.capture_bucket(num_reqs)
        tail.capture_bucket(num_reqs)
        if cont is not None:
            cont.capture_bucket(num_reqs, tail.graphs[num_reqs].outputs)
    prefill = None
    prefill_buckets = prefill_sizes(max_num_batched_tokens)
    if prefill_buckets:
        draft_prefill = None
        if speculator is not None:
            prepare = draft_input_preparer(speculator.drafter.attention_backend.name)
            draft_prefill = functools.partial(draft_after_prefill, speculator, prepare)
        request_buckets = prefill_request_sizes(max_num_seqs)
        prefill = PrefillGraphs(model, kv_caches, aux_layer_ids, draft_prefill, prefill_buckets, block_table_width,
                                kv_block_size, capture, pool, request_buckets, fp32_head=fp32_head)
        for num_rows in reversed(prefill_buckets):
            for num_reqs in reversed(request_buckets):
                prefill.capture_bucket(num_reqs, num_rows)
    if capture:
        logger.info("captured CUDA graphs for %d request buckets %s x %d rows and prefill buckets of %s requests "
                    "x %s rows in %.1f s (%.0f MiB more GPU memory reserved)", len(buckets), buckets, rows_per_req,
                    prefill.request_buckets if prefill else [], prefill_buckets, time.perf_counter() - started,
                    (torch.cuda.memory_reserved() - reserved_before) / 2**20)
    return StepGraphs(target, tail, cont, prefill)
