"""One static-shape function behind a CUDA graph, or run eagerly on the same static buffers.

Capture follows the PyTorch recipe: warm up on a side stream (Triton compiles, cuBLAS picks its
kernels, the caching allocator settles), then capture into a memory pool that every graph of the
engine shares (`torch.cuda.graph_pool_handle()`; graphs never run concurrently, and every graph's
outputs stay referenced so no later capture reuses their memory). Python's automatic garbage
collection is paused during each capture: a collection there that frees another engine's CUDA
graphs (a dropped engine in a reference cycle) destroys them mid-capture, which CUDA forbids and
which invalidates the capture ("operation not permitted when stream is capturing (function reset)";
recent torch's `torch.cuda.graph` collects before capturing only with
`torch.compiler.config.force_cudagraph_gc`, checked in 2.13). Eager mode calls the function
directly on the same buffers, so the padded static-shape path also runs (and is tested) on CPU.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator

import torch


class StaticGraph:
    """Runs `fn(*inputs)` whose inputs and outputs live at fixed addresses.

    Args:
        fn: a function of tensors that does no host synchronisation and no host-dependent control
            flow on tensor values (capturable).
        inputs: the tensors `fn` is captured with (capture mode only; replays read them in place).
        capture: True = capture a CUDA graph now; False = call `fn` eagerly on every run.
        pool: the shared graph memory pool (capture mode).
        num_warmup: eager runs before capture.
    """

    def __init__(self, fn: Callable[..., Any], inputs: tuple = (), capture: bool = False, pool=None, num_warmup: int = 2):
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self._input_ptrs = tuple(t.data_ptr() for t in inputs)
        if capture:
            self._capture(inputs, pool, num_warmup)

    def _capture(self, inputs: tuple, pool, num_warmup: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(num_warmup):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with _automatic_gc_paused(), torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.fn(*inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Replay (captured) or call `fn` (eager). Captured graphs must get the captured tensors.

        Raises:
            ValueError: a captured graph was given inputs at other addresses than at capture.
        """
        if self.graph is None:
            return self.fn(*inputs)
        if tuple(t.data_ptr() for t in inputs) != self._input_ptrs:
            raise ValueError("a captured CUDA graph must be replayed with the tensors it was captured with")
        self.graph.replay()
        return self.outputs


@contextlib.contextmanager
def _automatic_gc_paused() -> Iterator[None]:
    """Pause Python's automatic garbage collection in the block (restored after, also on errors);
    the cycles it would have freed are collected later, outside the capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
