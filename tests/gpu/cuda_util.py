"""Helpers for the compiled-kernel tests (CUDA only)."""

from __future__ import annotations

import contextlib

import torch


def poison_allocator() -> None:
    """Fill freed memory of both caching-allocator pools with NaN, so an output the kernel forgets
    to write (a torch.empty allocated next) shows up as NaN instead of a lucky zero."""
    small = [torch.full((64 * 1024,), float("nan"), device="cuda") for _ in range(64)]  # 256 KiB each
    large = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MiB
    del small, large


@contextlib.contextmanager
def no_host_sync():
    """Raise on any host-device synchronisation inside the block (torch's sync debug mode)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture(fn):
    """Warm `fn` up on a side stream (Triton compiles there), then capture one call of it in a
    CUDA graph. Returns (graph, output of the captured call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
