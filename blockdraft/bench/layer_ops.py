"""CUDA micro-benchmark of one decode step with and without the fused per-layer ops.

Small-batch decoding on a GPU is launch-bound: this times one decode step (model.forward over
`batch` one-token requests, then the LM head on those rows) of a random-weight model in bf16,
eager and replayed from a CUDA graph, with the Triton ops of `blockdraft.layers.fused_ops` on
and off, counts the kernels one step launches (torch.profiler), and compares the time to the HBM
floor = parameter bytes / 4.25e12 B/s (H200 peak bandwidth, every weight read once per step;
the embedding table counts although a step reads only `batch` rows of it).

Attention backends (`--attention`, several allowed; the model is built once and re-pointed):
    skip       no attention (returns q unchanged): the cost of everything else, i.e. of the ops
               this benchmark is about. Not a model of a real step. It takes no `kv_written`,
               so no K/V are written; with the other backends the q/k RoPE kernel writes them
               (on the kernel path), so "backend - skip" excludes the write there.
    dense      blockdraft.attention.dense_ref.paged_attention_dense: sync-free torch, capturable,
               but a test oracle (it gathers every page in fp32), so it inflates the step.
    triton     blockdraft.attention.triton_attention.paged_attention_triton, when that module exists.
    torch_ref  the CPU reference (host lists, a host sync per layer): eager only.
Every request has `--context` cached positions (zeros: only the cost matters) and writes its new
K/V at the same slot on every replay.

    python -m blockdraft.bench.layer_ops --preset qwen3-8b --batch 1 8 --out layer_ops.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable

import torch

from blockdraft.attention.interface import AttentionBackend
from blockdraft.attention.metadata import build_metadata
from blockdraft.bench.random_weights import fill_random_
from blockdraft.config import ModelConfig
from blockdraft.layers.fused_ops import set_fused_ops
from blockdraft.models import CausalLM, allocate_kv_caches, build_model

HBM_BYTES_PER_S = 4.25e12  # H200 peak

PRESETS = {
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
    ),
    "qwen2.5-0.5b": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True, qk_norm=False,
    ),
}  # fmt: skip

# Backends that read only device metadata (no host sync), so a step can be captured in a graph.
CAPTURABLE = {"skip", "dense", "triton"}


def skip_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, causal=True) -> torch.Tensor:
    """AttentionBackend that does no attention and returns q [rows, heads, head_dim] (see module doc)."""
    return q


def attention_backend(name: str) -> AttentionBackend:
    """The backend called `name` (see the module doc). Raises ValueError for an unknown or missing one."""
    where = {
        "dense": ("blockdraft.attention.dense_ref", "paged_attention_dense"),
        "triton": ("blockdraft.attention.triton_attention", "paged_attention_triton"),
        "torch_ref": ("blockdraft.attention.torch_ref", "paged_attention"),
    }
    if name == "skip":
        return skip_attention
    if name not in where:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(where) + ['skip']}")
    module, attr = where[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"attention backend {name!r} ({module}.{attr}) is not available on this branch: {e}") from e


def set_attention_backend(model: CausalLM, backend: AttentionBackend) -> None:
    """Point every decoder layer's attention at `backend` (CausalLM.set_attention_backend)."""
    model.set_attention_backend(backend)


def count_cuda_kernels(fn: Callable[[], object]) -> list[str]:
    """Names of the CUDA kernels (and memcpy / memset) one call of `fn` launches, in order.

    Call `fn` once before (Triton compilation and cuBLAS set-up launch extra work).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Mean milliseconds per call of `fn` over `iters` calls, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of `fn` (warmed up on a side stream first, as torch requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def decode_step(model: CausalLM, batch: int, context: int, kv_block_size: int = 16) -> Callable[[], torch.Tensor]:
    """A closure running one decode step of `batch` requests at position `context` -> logits [batch, V]."""
    config, device = model.config, next(model.parameters()).device
    pages = -(-(context + 1) // kv_block_size)
    caches = allocate_kv_caches(config, batch * pages, kv_block_size, next(model.parameters()).dtype, device)
    tables = [list(range(r * pages, (r + 1) * pages)) for r in range(batch)]
    meta = build_metadata([context + 1] * batch, [1] * batch, tables, kv_block_size, device=device)
    ids = torch.randint(0, config.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), context, device=device)

    def step() -> torch.Tensor:
        hidden, _ = model(ids, positions, caches, meta)
        return model.compute_logits(hidden)

    return step


def random_model(config: ModelConfig, device: str = "cuda", seed: int = 0) -> CausalLM:
    """bf16 model on `device` with N(0, 0.02) weights drawn there (seconds, not minutes, for 8B)."""
    model = build_model(config, torch.bfloat16, device, pack_weights=False)
    fill_random_(model, std=0.02, seed=seed)
    return model


def run(args: argparse.Namespace) -> dict:
    config = PRESETS[args.preset]
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers, layer_types=())
    model = random_model(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / HBM_BYTES_PER_S * 1e3
    results = []
    with torch.inference_mode():
        for attention in args.attention:
            set_attention_backend(model, attention_backend(attention))
            for batch in args.batch:
                step = decode_step(model, batch, args.context)
                for fused in (False, True):
                    set_fused_ops(model, fused)
                    eager = time_ms(step, args.iters, args.warmup)
                    kernels = count_cuda_kernels(step)
                    graph_ms = None
                    if attention in CAPTURABLE and not args.no_graph:
                        graph = capture(step)
                        graph_ms = time_ms(graph.replay, args.iters, args.warmup)
                        del graph
                    row = dict(attention=attention, batch=batch, fused=fused, eager_ms=eager, graph_ms=graph_ms,
                               kernels_per_step=len(kernels), kernels_per_layer=len(kernels) / config.num_hidden_layers,
                               graph_vs_floor=None if graph_ms is None else graph_ms / floor_ms)  # fmt: skip
                    results.append(row)
                    _print_row(row, floor_ms)
    return dict(
        preset=args.preset, layers=config.num_hidden_layers, context=args.context, weight_bytes=weight_bytes,
        hbm_floor_ms=floor_ms, hbm_bytes_per_s=HBM_BYTES_PER_S, device=torch.cuda.get_device_name(),
        torch=torch.__version__, triton=_triton_version(), results=results,
    )  # fmt: skip


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _print_row(row: dict, floor_ms: float) -> None:
    graph = "   n/a" if row["graph_ms"] is None else f"{row['graph_ms']:6.3f}"
    ratio = "  n/a" if row["graph_ms"] is None else f"{row['graph_ms'] / floor_ms:5.2f}x"
    print(
        f"attn={row['attention']:9s} batch={row['batch']:3d} fused={str(row['fused']):5s} "
        f"eager={row['eager_ms']:7.3f} ms  graph={graph} ms  floor={floor_ms:.3f} ms  graph/floor={ratio}  "
        f"kernels/step={row['kernels_per_step']} ({row['kernels_per_layer']:.1f}/layer)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b", help="model shape (default qwen3-8b)")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count (0 = the preset's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode rows per step (default 1 8)")
    parser.add_argument("--context", type=int, default=512, help="cached positions per request (default 512)")
    parser.add_argument("--attention", nargs="+", default=["skip", "dense"],
                        choices=["skip", "dense", "triton", "torch_ref"], help="backends (default skip dense)")
    parser.add_argument("--iters", type=int, default=50, help="timed steps (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--no-graph", action="store_true", help="time eager only")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("blockdraft.bench.layer_ops needs a CUDA device")
    report = run(args)
    print(f"weights {report['weight_bytes'] / 1e9:.2f} GB -> HBM floor {report['hbm_floor_ms']:.3f} ms per step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
