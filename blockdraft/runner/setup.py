"""Builds a ModelRunner for a device: attention backend, KV pool size, caches, CUDA graphs.

CPU: the torch reference backend, the configured pool, no graphs (unchanged behaviour).
CUDA: the Triton backend (dense torch twin without Triton), the pool sized from GPU memory unless
num_kv_blocks is given, and CUDA graphs for uniform decode / verify steps unless enforce_eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockdraft.attention.backends import AttentionBackendSpec, select_attention_backend
from blockdraft.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_max_model_len
from blockdraft.errors import param_error
from blockdraft.layers.fused_ops import TRITON_AVAILABLE, set_batch_invariant
from blockdraft.models import allocate_kv_caches
from blockdraft.runner.kv_budget import kv_bytes_per_page
from blockdraft.runner.model_runner import ModelRunner
from blockdraft.runner.step_graphs import build_step_graphs
from blockdraft.sample.sampler import warm_up_compiled_sampler

GRAPH_MODES = ("capture", "eager", "off")


@dataclass
class RunnerSetup:
    """The runner and the pool it was built with (the scheduler needs the same numbers)."""

    runner: ModelRunner
    num_kv_blocks: int
    max_model_len: int


def check_fp32_lm_head(enabled: bool, device: str) -> None:
    """enable_fp32_lm_head (--enable-fp32-lm-head) needs CUDA (torch.mm out_dtype); checked
    before any weights load.

    Raises:
        ValueError: enabled on another device (names the option and the device; .param).
    """
    if enabled and device != "cuda":
        raise param_error("enable_fp32_lm_head", f"enable_fp32_lm_head runs on CUDA only, the device is {device!r}: "
                          f"leave it off there (with float32 weights, --dtype float32, the logits are float32 anyway)")


def check_batch_invariant(enabled: bool, device: str, attention_backend: str | None = None) -> None:
    """batch_invariant (--batch-invariant) runs on CUDA with the Triton attention kernels; checked
    before any weights load (build_runner checks a ready backend spec again). Not on the CPU: its
    decode and verify rows are row-invariant as they are (tests/models/test_batch_invariance.py),
    but its attention over prefill blocks of more than 32 rows is not (a prompt's answer can
    depend on how its prefill was chunked, e.g. under load or with a prefix-cache hit), and this
    mode does not change that.

    Raises:
        ValueError: enabled on another device, or on CUDA with attention_backend "dense" or
            "torch", or without triton (names the option; .param).
    """
    if enabled and device != "cuda":
        raise param_error("batch_invariant", f"batch_invariant runs on CUDA only, the device is {device!r}: on the "
                                             f"CPU a prompt's prefill attention depends on how it is chunked, which "
                                             f"this mode does not change (decode and verify rows are row-invariant "
                                             f"there as they are); leave it off")  # fmt: skip
    if enabled and device == "cuda" and (attention_backend not in (None, "triton") or not TRITON_AVAILABLE):
        got = "triton is not installed" if attention_backend in (None, "triton") else f"got {attention_backend!r}"
        raise param_error("batch_invariant", f"batch_invariant on CUDA needs the 'triton' attention backend "
                                             f"(its kernels): {got}")  # fmt: skip


def build_runner(
    model,
    config: ModelConfig,
    speculator,
    cache: CacheConfig,
    sched: SchedulerConfig,
    device: str | torch.device,
    enforce_eager: bool = False,
    attention_backend: str | AttentionBackendSpec | None = None,
    graph_mode: str | None = None,
    continuation_graphs: bool = True,
    disable_by_batch_size: int | None = None,
    fp32_lm_head: bool = False,
    batch_invariant: bool = False,
) -> RunnerSetup:
    """Set the models' attention backend, size and allocate the KV pool, capture graphs.

    Args:
        model / config: the target CausalLM (weights loaded, on `device`) and its config.
        speculator: None, or a speculator; a DFlash drafter gets the same backend and its caches
            are (re)allocated to the pool's page count.
        cache: num_kv_blocks None sizes the pool from GPU memory (CUDA only), to hold at least
            one request of sched.max_model_len tokens (else of the model's max_position_embeddings).
        sched: the step limits, and max_model_len (None: the model's context, capped by the pool;
            blockdraft.config.resolve_max_model_len).
        enforce_eager: never capture CUDA graphs (vLLM's --enforce-eager).
        attention_backend: "torch" | "dense" | "triton" | None (the device's default), or a
            ready AttentionBackendSpec (tests run the Triton kernels under the interpreter on CPU).
        graph_mode: None = "capture" on CUDA unless enforce_eager, else "off"; "eager" runs the
            padded static-shape graph code without capturing (tests; any device).
        continuation_graphs: also build async scheduling's continuation graphs (the engine passes
            its async_scheduling; without them `ModelRunner.can_continue` is always False).
        disable_by_batch_size: steps of this many requests or more decode without drafts
            (ModelRunner; needs graph mode "off").
        fp32_lm_head: float32 logits from the LM head's bf16 / fp16 operands, eager and graphed
            (CausalLM.compute_logits fp32_head; vLLM's --enable-fp32-lm-head); CUDA only.
        batch_invariant: the target's matmuls, LM head and attention give each row the same bits
            whatever the batch (`blockdraft.layers.fused_ops.set_batch_invariant`), set on the
            model before the memory profile and graph capture (each step of the runner re-applies
            it: ModelRunner batch_invariant). CUDA only (check_batch_invariant), with the 'triton'
            backend and the fused ops.
    Raises:
        ValueError: weights on another device, an unknown graph mode or one the backend / device
            cannot do, num_kv_blocks None on a CPU device, a GPU memory budget that cannot hold
            one request, a KV pool the device's memory cannot allocate (names the pool's size), or
            a max_model_len above the model's positions or the pool (resolve_max_model_len),
            batch_invariant where its kernels cannot run (names the reason; .param batch_invariant).
    """
    device = torch.device(device)
    weights_device = next(model.parameters()).device
    if weights_device.type != device.type:
        raise ValueError(f"the target's weights are on {weights_device} but the engine runs on {device}")
    backend = _backend(device, attention_backend)
    mode = _graph_mode(graph_mode, device, enforce_eager, backend)
    if cache.num_kv_blocks is None and device.type != "cuda":
        raise ValueError(f"num_kv_blocks must be given on {device}: sizing the KV pool from memory needs CUDA")
    check_fp32_lm_head(fp32_lm_head, device.type)
    _set_batch_invariant(model, batch_invariant, device, backend)
    model.set_attention_backend(backend.attention)
    drafter = getattr(speculator, "drafter", None)
    if drafter is not None:
        drafter.set_attention_backend(backend)
    resolve_max_model_len(sched.max_model_len, config.max_position_embeddings, None, cache.kv_block_size)
    num_kv_blocks = cache.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = _pool_from_memory(model, config, speculator, cache, sched, device, mode == "capture",
                                          fp32_lm_head)
    # A request must always fit the pool on its own, or preempting it could never make room.
    max_model_len = resolve_max_model_len(sched.max_model_len, config.max_position_embeddings, num_kv_blocks,
                                          cache.kv_block_size, pool_from_memory=cache.num_kv_blocks is None)
    dtype = next(model.parameters()).dtype
    try:
        if drafter is not None and _num_pages(speculator.kv_caches) != num_kv_blocks:
            speculator.allocate_kv_caches(num_kv_blocks)
        kv_caches = allocate_kv_caches(config, num_kv_blocks, cache.kv_block_size, dtype, device)
    except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, "can't allocate memory" on the CPU
        if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e):
            raise
        layers = [(config.num_key_value_heads, config.head_dim)] * config.num_hidden_layers
        per_page = kv_bytes_per_page(cache.kv_block_size, layers, dtype.itemsize)
        if drafter is not None:
            per_page += speculator.kv_bytes_per_block()
        raise ValueError(
            f"the KV pool of {num_kv_blocks} pages x {cache.kv_block_size} tokens ({num_kv_blocks * per_page / 2**30:.1f}"
            f" GiB{' with the drafter' if drafter is not None else ''}) does not fit in {device} memory: lower "
            f"num_kv_blocks (--num-kv-blocks) or the concurrent requests it is sized for "
            f"(--max-num-seqs; bench: --batch-sizes, --max-tokens)"
        ) from None
    # torch.compile'd sampling where CUDA graphs are captured (so never with enforce_eager, as vLLM),
    # compiled here, before the capture, rather than inside the first sampled step
    if mode == "capture":
        warm_up_compiled_sampler(config.vocab_size, device)
    graphs = None
    if mode != "off":
        with torch.inference_mode():
            graphs = build_step_graphs(
                model, kv_caches, speculator, sched.max_num_seqs, sched.max_num_batched_tokens,
                math.ceil(max_model_len / cache.kv_block_size), cache.kv_block_size, capture=mode == "capture",
                continuation=continuation_graphs, fp32_head=fp32_lm_head,
            )
    runner = ModelRunner(model, kv_caches, cache.kv_block_size, device, speculator, backend, graphs,
                         compiled_sampling=mode == "capture", disable_by_batch_size=disable_by_batch_size,
                         fp32_head=fp32_lm_head, batch_invariant=model.batch_invariant)  # fmt: skip
    return RunnerSetup(runner, num_kv_blocks, max_model_len)


def _set_batch_invariant(model, enabled: bool, device: torch.device, backend: AttentionBackendSpec) -> None:
    """Switch the target's batch-invariant kernels (see build_runner): CUDA only, with the Triton
    backend and the fused ops (the torch twins' reductions are not row-invariant there)."""
    check_batch_invariant(enabled, device.type)
    if enabled:
        if not getattr(backend.attention, "accepts_batch_invariant", False):
            raise param_error("batch_invariant", f"batch_invariant on CUDA needs the 'triton' attention backend "
                                                 f"(its kernels), got {backend.name!r}")  # fmt: skip
        if not model.fused_ops:
            raise param_error("batch_invariant", "batch_invariant on CUDA needs the model's fused ops (Triton "
                                                 "kernels); this model has them switched off (set_fused_ops)")  # fmt: skip
    set_batch_invariant(model, enabled)


def resolve_graph_mode(
    device: str | torch.device, enforce_eager: bool = False,
    attention_backend: str | AttentionBackendSpec | None = None, graph_mode: str | None = None,
) -> str:
    """The graph mode `build_runner` will use ("capture" | "eager" | "off"), without weights.

    Raises:
        ValueError: as build_runner for an unknown or impossible graph mode or backend.
    """
    device = torch.device(device)
    return _graph_mode(graph_mode, device, enforce_eager, _backend(device, attention_backend))


def _backend(device: torch.device, attention_backend: str | AttentionBackendSpec | None) -> AttentionBackendSpec:
    if isinstance(attention_backend, AttentionBackendSpec):
        return attention_backend
    return select_attention_backend(device, attention_backend)


def _graph_mode(mode: str | None, device: torch.device, enforce_eager: bool, backend: AttentionBackendSpec) -> str:
    if mode is None:
        return "capture" if device.type == "cuda" and not enforce_eager and not backend.host_metadata else "off"
    if mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode must be one of {list(GRAPH_MODES)} or None, got {mode!r}")
    if mode != "off" and backend.host_metadata:
        raise ValueError(f"graph_mode {mode!r} needs an attention backend without host metadata, not {backend.name!r}")
    if mode == "capture" and (device.type != "cuda" or enforce_eager):
        raise ValueError(f"graph_mode 'capture' needs a CUDA device and enforce_eager=False (device {device})")
    return mode


def _pool_from_memory(model, config, speculator, cache, sched, device, cuda_graphs: bool, fp32_head: bool) -> int:
    from blockdraft.runner.memory_profile import num_kv_blocks_for_gpu

    return num_kv_blocks_for_gpu(
        model, config, speculator, cache.kv_block_size, sched.max_num_batched_tokens, sched.max_num_seqs,
        cache.gpu_memory_utilization, cuda_graphs, device, min_tokens=sched.max_model_len, fp32_head=fp32_head,
    )


def _num_pages(kv_caches) -> int | None:
    return kv_caches[0][0].shape[0] if kv_caches else None
