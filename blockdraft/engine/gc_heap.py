"""Keep Python's cyclic garbage collector off the heap that exists when decoding starts.

A full (oldest-generation) collection walks every tracked object in the process. Next to a loaded
model that is hundreds of thousands of objects (torch, transformers, Triton and compile caches):
on the CPU host-overhead bench (344K tracked objects) one full collection took 134 ms and landed
inside a 250 ms `generate` call once every few calls (docs/benchmarks/gpu.md, "Session 10").
Decoding allocates steadily (requests, outputs, lists of token ids), so such collections fire
mid-run, where they stall a host-bound step loop. (It did not explain the spread of our plain
batch-32 step on the H200, 1.32-2.16 ms depending on what ran before in the process: that stayed
with the heap frozen, "Session 11".)

`frozen_gc_heap()` moves everything alive at entry into the permanent generation (`gc.freeze()`,
O(1)), so collections during the block only walk objects made inside it, and gives it back on exit
(`gc.unfreeze()`, O(1)); cycles that die meanwhile are collected after the block as usual. vLLM
does the same once after engine start-up (`gc.freeze()` of the start-up heap); a library call is
scoped so that a process which builds and drops many engines still frees them.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def frozen_gc_heap() -> Iterator[bool]:
    """Context manager: freeze the current heap for the block -> yields whether it froze.

    Does nothing (yields False) when the collector is disabled or something is frozen already
    (the caller's own `gc.freeze()`, or an outer block), so it never unfreezes what it did not
    freeze.
    """
    if not gc.isenabled() or gc.get_freeze_count():
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
