"""frozen_gc_heap: the heap alive when decoding starts stays out of cyclic collections, only then."""

from __future__ import annotations

import gc
import weakref

from blockdraft.engine.gc_heap import frozen_gc_heap
from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freezes_the_heap_for_the_block_and_gives_it_back():
    assert gc.get_freeze_count() == 0
    before = _Node()
    with frozen_gc_heap() as froze:
        assert froze and gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # frozen objects are not in any generation
        inside = _Node()
        assert any(o is inside for o in gc.get_objects())  # new objects are collected as usual
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects())


def test_a_frozen_cycle_that_dies_in_the_block_is_collected_after_it():
    node = _Node()
    ref = weakref.ref(node)
    with frozen_gc_heap():
        del node
        gc.collect()
        assert ref() is not None  # frozen: the collector does not look at it
    gc.collect()
    assert ref() is None


def test_leaves_a_caller_freeze_and_a_disabled_collector_alone():
    node = _Node()
    gc.freeze()
    try:
        with frozen_gc_heap() as froze:
            assert not froze
        # not unfrozen by the block: the caller's frozen object is still in no generation (the
        # freeze count itself drops whenever any frozen object is freed, which made it flaky)
        assert gc.get_freeze_count() > 0 and not any(o is node for o in gc.get_objects())
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with frozen_gc_heap() as froze:
            assert not froze and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def _llm_recording_freeze_counts(target):
    """An LLM whose engine records gc.get_freeze_count() at every step -> (llm, the list)."""
    llm = make_llm(target)
    counts = []
    step = llm.engine.step

    def counting_step(*args, **kwargs):
        counts.append(gc.get_freeze_count())
        return step(*args, **kwargs)

    llm.engine.step = counting_step
    return llm, counts


def test_generate_decodes_with_the_heap_frozen(llama_target):
    llm, counts = _llm_recording_freeze_counts(llama_target)
    llm.generate(random_prompts(3, seed=4), SamplingParams(max_tokens=5))
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0


def test_the_server_engine_thread_serves_with_the_heap_frozen(llama_target):
    import asyncio
    import time

    from blockdraft.server.async_engine import AsyncEngine

    llm, counts = _llm_recording_freeze_counts(llama_target)

    async def serve_one():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            group = await engine.submit(random_prompts(1, seed=2), [SamplingParams(max_tokens=4)], time.time())
            async for _ in group.updates():
                pass
        finally:
            await engine.shutdown()

    asyncio.run(serve_one())
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0  # given back when the engine thread ends
