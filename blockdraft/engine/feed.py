"""Feeding a list of prompts to an LLMEngine through a window of requests in flight.

The loop shared by the benchmark's load cells (at most N requests in flight, the next sent as one
finishes: vLLM's `benchmark_serving --max-concurrency`), its load profile, and the drafter
training's answer generation (a short queue, so that a wall-clock deadline aborts few requests).
`LLM.generate` queues every prompt at once instead.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from blockdraft.engine.gc_heap import frozen_gc_heap
from blockdraft.engine.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams

_CALLS = itertools.count()  # numbers the calls: request ids stay unique on a shared engine


def feed_requests(
    engine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    in_flight: int,
    *,
    deadline: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    id_prefix: str = "feed",
    on_finished: Callable[[RequestOutput], None] | None = None,
) -> list[RequestOutput | None]:
    """Run `prompts` through `engine` with at most `in_flight` of them unfinished at once.

    As `LLM.generate`, it needs the engine to itself (a step returns every request's final
    output, and only this call's are kept): every prompt is checked before any is queued, and the
    step loop runs with the garbage collector's heap frozen (engine/gc_heap.py). On an error the
    requests of this call still in the engine are aborted; at the deadline too, and then, when
    nothing else runs, one more step reads back a step still in flight (async scheduling) and the
    aborted requests' outputs, so the engine is left empty.

    Args:
        engine: an LLMEngine (add_request / step / abort_request / check_request).
        prompts: token id lists.
        params: one SamplingParams for every prompt, or a list / tuple of one per prompt.
        in_flight: requests of this call unfinished in the engine at most (running + waiting), >= 1.
        deadline: `time.time()` seconds; once past it no further step starts, the unfinished
            requests are aborted and their entries are None. None = run to the end.
        should_stop: checked before each step; once it returns True the run stops as at the
            deadline (train-drafter's Ctrl-C while answering). None = never.
        id_prefix: request ids are f"{id_prefix}-{call}-{index}".
        on_finished: called with each final output as it arrives (progress bars).
    Returns:
        The final RequestOutput of each prompt, in input order (None: cut by the deadline or
        should_stop).
    Raises:
        ValueError: in_flight < 1, a params list of another length than prompts, or a prompt the
            engine refuses (engine.check_request; nothing queued then).
        RuntimeError: the engine ran dry while requests of this call had no final output.
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"got {len(per_prompt)} sampling params for {len(prompts)} prompts")
    for prompt, p in zip(prompts, per_prompt):
        engine.check_request(prompt, p)
    call = next(_CALLS)
    out: list[RequestOutput | None] = [None] * len(prompts)
    index: dict[str, int] = {}
    fed = 0
    try:
        with frozen_gc_heap():
            while fed < len(prompts) or index:
                if (deadline is not None and time.time() > deadline) or (should_stop is not None and should_stop()):
                    break
                while fed < len(prompts) and len(index) < in_flight:
                    rid = f"{id_prefix}-{call}-{fed}"
                    engine.add_request(rid, prompts[fed], per_prompt[fed])
                    index[rid] = fed
                    fed += 1
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no unfinished requests but {len(index)} of this call's "
                                       f"have no final output")
                for o in engine.step(stream=False):
                    if o.finished and o.request_id in index:
                        out[index.pop(o.request_id)] = o
                        if on_finished is not None:
                            on_finished(o)
    except BaseException:
        for rid in index:  # stopped and their pages freed at once
            engine.abort_request(rid)
        raise
    if index:  # past the deadline, or told to stop
        for rid in index:
            engine.abort_request(rid)
        if not engine.has_unfinished_requests():
            engine.step(stream=False)  # reads back a step still in flight; pops the aborted outputs
    return out
