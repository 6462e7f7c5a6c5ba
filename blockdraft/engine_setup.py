"""Assemble an engine from a loaded target: the DFlash speculator, the runner (backend, KV pool,
CUDA graphs), the scheduler and the LLMEngine, and the checks of the options that decide how
steps run (async scheduling, mixed prefill, disabling speculation by batch size), done before any
weights load."""

from __future__ import annotations

import dataclasses

from blockdraft.config import CacheConfig, SchedulerConfig
from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.engine.scheduler import Scheduler
from blockdraft.errors import param_error
from blockdraft.model_loader import LoadedTarget, eos_token_ids
from blockdraft.preflight import Preflight
from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS


def build_speculator(pre: Preflight, target: LoadedTarget):
    """The DFlash speculator for the drafter, K and draft vocabulary that `preflight` resolved and
    checked, in the target's dtype, on `pre.device` (packed for oneDNN where the target is).

    Raises:
        ValueError / FileNotFoundError: the drafter's weights do not load (load_drafter) or its
            draft vocabulary does not fit the target (build_draft_head).
    """
    from blockdraft.spec.dflash.checkpoint import load_drafter
    from blockdraft.spec.dflash.speculator import DFlashSpeculator
    from blockdraft.spec.draft_vocab import build_draft_head

    drafter = load_drafter(pre.draft, target.config, dtype=target.dtype, device=pre.device)
    if getattr(target.model, "packed", False):  # the target's weights are packed for oneDNN: the drafter's too
        drafter.pack_for_cpu_inference()
    head = build_draft_head(target.model, pre.draft, pre.draft_vocab_size)
    k = pre.num_speculative_tokens
    return DFlashSpeculator(drafter, target.model, k, pre.cache.num_kv_blocks, pre.cache.kv_block_size, head)


def check_bool_options(**options) -> None:
    """Each keyword's value must be a bool (LLM's on/off options: a string such as "yes" or "false"
    would otherwise count as on).

    Raises:
        ValueError: the first option that is not True / False (names it and the value; .param).
    """
    for name, value in options.items():
        if not isinstance(value, bool):
            raise param_error(name, f"{name} must be True or False, got {value!r}")


def resolve_async_scheduling(requested: bool | None, device, enforce_eager: bool, attention_backend, graph_mode) -> bool:
    """None -> True iff CUDA graphs are captured; True is checked (before any weights load).

    Raises:
        ValueError: a value other than None / True / False, or True where the graph mode resolves
            to "off" (names device, enforce_eager, the attention backend and graph_mode).
    """
    from blockdraft.runner.setup import resolve_graph_mode

    if requested is not None and not isinstance(requested, bool):
        raise ValueError(f"async_scheduling must be None, True or False, got {requested!r}")
    mode = resolve_graph_mode(device, enforce_eager, attention_backend, graph_mode)
    if requested is None:
        return mode == "capture"
    if requested and mode == "off":
        python_only = ""  # the test-only knobs, named only to who set one (never the CLI)
        if attention_backend is not None or graph_mode is not None:
            python_only = (f" In Python (tests) graph_mode='eager' with attention_backend='dense' runs the same graph "
                           f"code without CUDA (got attention_backend={attention_backend!r}, graph_mode={graph_mode!r})")
        raise ValueError(
            f"async scheduling needs the CUDA graphs of decode steps, which are off here (device {device}"
            f"{', --enforce-eager' if enforce_eager else ''}): run on CUDA without --enforce-eager, or turn it off "
            f"(drop --async-scheduling or pass --no-async-scheduling; LLM(async_scheduling=False)).{python_only}"
        )
    return requested


def resolve_disable_by_batch_size(value: int | None, drafter_asked: bool, plain: bool, device, enforce_eager: bool,
                                  attention_backend, graph_mode) -> int | None:
    """The runner's disable_by_batch_size (`check_disable_by_batch_size`'d), before any weights load.

    drafter_asked: a drafter or speculator was given (draft not None); plain: none resolved
    (draft="auto" decodes plainly): nothing to disable, None, whatever the graph mode.
    Raises:
        ValueError: set without a drafter, or where the graph mode (as resolve_graph_mode) is not
            "off": graphed decode steps always draft in their tail graph.
    """
    from blockdraft.runner.setup import resolve_graph_mode

    if value is None:
        return None
    if not drafter_asked:
        raise param_error("speculative_disable_by_batch_size", f"speculative_disable_by_batch_size needs a drafter "
                          f"(got {value}): give draft (a drafter folder, 'shipped' or 'auto'), or leave it out")
    if plain:
        return None
    mode = resolve_graph_mode(device, enforce_eager, attention_backend, graph_mode)
    if mode != "off":
        test_knob = f" or graph_mode='off' (got graph_mode={graph_mode!r})" if graph_mode is not None else ""
        raise param_error("speculative_disable_by_batch_size", (
            f"speculative_disable_by_batch_size works on eager steps only (got {value}), but decode steps here run "
            f"the CUDA-graph code (graph mode {mode!r}), which always drafts: pass enforce_eager=True "
            f"(--enforce-eager){test_knob}"
        ))  # fmt: skip
    return value


def resolve_mixed_prefill(requested: bool | None, graphs_captured: bool) -> bool:
    """None -> False iff the uniform decode / verify steps replay captured CUDA graphs (a mixed
    step would run eagerly; separate prefill steps keep them on their graphs), else True (one
    eager forward instead of two); True / False are kept.

    Raises:
        ValueError: a value other than None / True / False.
    """
    if requested is not None and not isinstance(requested, bool):
        raise ValueError(f"mixed_prefill must be None, True or False, got {requested!r}")
    return (not graphs_captured) if requested is None else requested


def build_engine(
    target: LoadedTarget, cache: CacheConfig, sched: SchedulerConfig, speculator, device,
    async_scheduling: bool = False, max_logprobs: int = DEFAULT_MAX_LOGPROBS, mixed_prefill: bool | None = None,
    **runner_options
) -> LLMEngine:
    """Runner (backend, KV pool, graphs; see blockdraft.runner.setup.build_runner) + scheduler + engine.

    mixed_prefill: None resolves by resolve_mixed_prefill once the graphs are known; with graphs
    and no mixed prefill, a prefill step is capped at the largest prefill graph. runner_options:
    passed on to build_runner (gpu_memory_utilization, enforce_eager, ...).
    Raises:
        ValueError: async_scheduling without uniform-step graphs (names max_num_batched_tokens),
            and build_runner's errors (a KV pool the GPU memory cannot hold, naming the knob).
    """
    from blockdraft.runner.setup import build_runner

    setup = build_runner(target.model, target.config, speculator, cache, sched, device,
                         continuation_graphs=async_scheduling, **runner_options)
    if async_scheduling and setup.runner.graphs is None:
        raise ValueError(
            "async_scheduling=True needs uniform-step graphs, but none were built: the speculator is not a DFlash "
            f"drafter or max_num_batched_tokens ({sched.max_num_batched_tokens}) is below the rows of one step "
            "(1 + K); turn async scheduling off"
        )
    kv = KVCacheManager(setup.num_kv_blocks, cache.kv_block_size, cache.enable_prefix_caching)
    graphs = setup.runner.graphs
    mixed_prefill = resolve_mixed_prefill(mixed_prefill, graphs_captured=setup.runner.graphs_captured)
    sched = dataclasses.replace(sched, mixed_prefill=mixed_prefill,
                                num_speculative_tokens=getattr(speculator, "num_speculative_tokens", 0))
    if not mixed_prefill and graphs is not None and graphs.prefill is not None:
        # a prefill step of several prompts stays within the largest prefill graph
        sched = dataclasses.replace(sched, max_prefill_tokens=graphs.prefill.buckets[-1],
                                    max_prefill_seqs=graphs.prefill.request_buckets[-1])
    scheduler = Scheduler(sched, kv)
    return LLMEngine(scheduler, setup.runner, target.tokenizer, eos_token_ids(target), setup.max_model_len,
                     target.config.vocab_size, async_scheduling=async_scheduling, max_logprobs=max_logprobs,
                     max_position_embeddings=target.config.max_position_embeddings)
