"""StaticGraph's capture with the CUDA calls replaced by fakes (this machine has no GPU): Python's
automatic garbage collection is paused exactly while the graph captures, so a collection cannot
destroy another engine's graphs mid-capture, and it is restored afterwards, also when the
captured function raises."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from blockdraft.runner import static_graph
from blockdraft.runner.static_graph import StaticGraph


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream / graph calls as no-ops that record gc.isenabled() at capture."""
    seen = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None):
        seen.append(("enter", gc.isenabled()))
        yield
        seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return seen


def test_automatic_gc_is_paused_only_while_capturing(fake_cuda):
    assert gc.isenabled()
    during = []
    graph = StaticGraph(lambda x: during.append(gc.isenabled()) or x + 1, (torch.ones(2),), capture=True, num_warmup=2)
    assert during == [True, True, False]  # two eager warm-ups with collection on, then the capture
    assert fake_cuda == [("enter", False), ("exit", False)]
    assert gc.isenabled() and torch.equal(graph.outputs, torch.full((2,), 2.0))


def test_gc_is_restored_when_the_capture_raises(fake_cuda):
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) == 3:  # the captured call
            raise RuntimeError("capture failed")
        return x

    with pytest.raises(RuntimeError, match="capture failed"):
        StaticGraph(fn, (torch.ones(2),), capture=True, num_warmup=2)
    assert gc.isenabled()


def test_a_disabled_gc_stays_disabled():
    gc.disable()
    try:
        with static_graph._automatic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
