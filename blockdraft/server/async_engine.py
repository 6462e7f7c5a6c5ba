"""Drive the synchronous LLMEngine from asyncio: one thread owns the engine, requests talk to it by queue.

Threads:
    engine thread   the only code that touches LLMEngine. Loop: take add/abort commands from a
                    thread-safe queue (blocking while idle), run `step()`, update metrics, and hand
                    the outputs to the event loop with `call_soon_threadsafe`.
    event loop      HTTP handlers. `submit()` queues the choices of one HTTP request as a
                    RequestGroup and awaits the engine's verdict (ValueError for a refused prompt);
                    `RequestGroup.updates()` yields the newest output of each choice;
                    `abort()` (client gone) drops the group and tells the engine to free its KV pages.

Outputs are cumulative (text, token ids and logprobs so far), so a group keeps only the newest
output per choice: a slow reader never makes memory grow, it just receives bigger deltas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from blockdraft.engine.gc_heap import frozen_gc_heap
from blockdraft.engine.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams

logger = logging.getLogger("blockdraft.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a failed step, or shutdown); no request can finish."""


class ServerBusyError(RuntimeError):
    """Too many requests admitted and unfinished; the caller should retry later (HTTP 429)."""


@dataclass
class _Add:
    items: list[tuple[str, list[int], SamplingParams]]  # (request id, prompt token ids, params)
    arrival: float  # time.perf_counter() when the HTTP request arrived
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class RequestGroup:
    """The engine requests (choices) of one HTTP request. Event-loop side only.

    Invariant: `_pending` holds, per choice index, the newest output not yet yielded.
    """

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._pending: dict[int, RequestOutput] = {}
        self._finished: set[int] = set()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return len(self._finished) == len(self.request_ids)

    @property
    def failed(self) -> bool:
        """The engine stopped (or the server is shutting down) before the group finished."""
        return self._error is not None

    def unfinished_ids(self) -> list[str]:
        return [rid for i, rid in enumerate(self.request_ids) if i not in self._finished]

    async def updates(self) -> AsyncIterator[dict[int, RequestOutput]]:
        """Yield {choice index: newest output} until every choice has finished.

        Raises:
            EngineDeadError: the engine stopped before the group finished.
        """
        while not self.finished:
            await self._wake.wait()
            self._wake.clear()
            if self._error is not None:
                raise self._error
            batch, self._pending = self._pending, {}
            self._finished.update(i for i, out in batch.items() if out.finished)
            if batch:
                yield batch

    async def results(self) -> list[RequestOutput]:
        """The final output of every choice, in choice order (waits for all)."""
        final: dict[int, RequestOutput] = {}
        async for batch in self.updates():
            final.update(batch)
        return [final[i] for i in range(len(self.request_ids))]

    def _push(self, index: int, out: RequestOutput) -> None:
        self._pending[index] = out
        self._wake.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()


class AsyncEngine:
    """Owns an LLMEngine in a background thread; all methods are called from the event loop.

    Args:
        engine: the LLMEngine (not used by anyone else afterwards).
        metrics: a server Metrics (updated in the engine thread after each step), or None.
        max_pending: engine requests admitted and unfinished at most; `submit` raises
            ServerBusyError beyond it (the scheduler itself queues requests while the KV pool is full).
    """

    def __init__(self, engine, metrics=None, max_pending: int = 1024) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="blockdraft-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._index: dict[str, tuple[RequestGroup, int]] = {}  # live request id -> (group, choice)
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._needs_step = False  # engine thread only: an abort left finished outputs to collect
        self._closing: str | None = None  # fail_open's reason: the server is shutting down, submit refuses

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the engine thread (call from inside the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; unfinished groups fail with EngineDeadError."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def fail_open(self, reason: str) -> int:
        """Abort every unfinished request (their KV pages freed) and fail their groups with
        EngineDeadError(reason), so waiting handlers answer 503 and streams end with an error event
        (a server shutting down past its grace period); later `submit`s raise EngineDeadError(reason)
        too (a request whose body or tokenization was still under way). Returns the number of
        groups failed."""
        self._closing = reason
        groups = {id(g): g for g, _ in self._index.values()}
        for g in groups.values():
            self.abort(g)
            g._fail(EngineDeadError(reason))
        return len(groups)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def num_pending(self) -> int:
        """Engine requests submitted and not finished (nor aborted)."""
        return len(self._index)

    async def submit(
        self, prompts: list[list[int]], params: list[SamplingParams], arrival: float, prefix: str = "req"
    ) -> RequestGroup:
        """Queue one engine request per (prompt, params) pair, as one group.

        Raises:
            EngineDeadError: the engine thread is not running, or the server is shutting down (fail_open).
            ServerBusyError: more than `max_pending` engine requests would be unfinished.
            ValueError: the engine refused a prompt (the group's other requests are dropped).
            ImportError: structured outputs asked of a server without llguidance (dropped too).
        """
        if any(p.structured_outputs is not None for p in params):
            # compiled off the engine thread (the engine then copies the grammar state), and first:
            # nothing may await between the checks below and queueing the requests
            await asyncio.to_thread(self.engine.prepare_structured_outputs, params)
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if self._closing is not None:
            raise EngineDeadError(self._closing)
        if self.num_pending + len(prompts) > self.max_pending:
            raise ServerBusyError(f"{self.num_pending} choices are in flight and this request adds {len(prompts)} (limit "
                                  f"{self.max_pending}, --max-pending); retry later")
        n = next(self._ids)
        group = RequestGroup([f"{prefix}-{n}-{i}" for i in range(len(prompts))])
        for i, rid in enumerate(group.request_ids):
            self._index[rid] = (group, i)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(list(zip(group.request_ids, prompts, params)), arrival, done))
        try:
            await asyncio.wrap_future(done)
        except (ValueError, ImportError):
            self._forget(group)
            raise
        except BaseException:  # cancelled while waiting: the requests may be in the engine already
            self.abort(group)
            raise
        return group

    def abort(self, group: RequestGroup) -> None:
        """Drop a group's unfinished requests and free their KV pages (idempotent)."""
        for rid in group.unfinished_ids():
            if self._index.pop(rid, None) is not None:
                self._commands.put(_Abort(rid))

    def _forget(self, group: RequestGroup) -> None:
        for rid in group.request_ids:
            self._index.pop(rid, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._index.get(out.request_id)
            if entry is None:  # aborted: nobody listens any more
                continue
            group, i = entry
            group._push(i, out)
            if out.finished:
                del self._index[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        groups = {id(g): g for g, _ in self._index.values()}
        self._index.clear()
        for g in groups.values():
            g._fail(error)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            with frozen_gc_heap():  # the start-up heap stays out of collections while serving
                self._serve()
        except BaseException as e:  # a failed step: fail every waiting client instead of hanging them
            logger.exception("engine step failed; the engine is stopped")
            self._error = e
            self._post(self._fail_all, EngineDeadError(f"the engine failed: {e!r}"))
        finally:
            self._refuse_queued_adds()

    def _serve(self) -> None:
        """Step the engine while commands keep it running (engine thread)."""
        while self._serve_commands():
            if self.engine.has_unfinished_requests() or self._needs_step:
                self._needs_step = False
                outputs = self.engine.step()
                if self.metrics is not None:
                    self.metrics.on_step(self.engine, outputs)
                if outputs:
                    self._post(self._dispatch, outputs)

    def _refuse_queued_adds(self) -> None:
        """The thread is ending: adds still queued get EngineDeadError instead of waiting forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.done.set_exception(EngineDeadError("the engine is not running"))

    def _serve_commands(self) -> bool:
        """Apply queued commands; block for one while the engine is idle. False on stop."""
        idle = not (self.engine.has_unfinished_requests() or self._needs_step)
        while True:
            try:
                cmd = self._commands.get(block=idle)
            except queue.Empty:
                return True
            idle = False
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                self.engine.abort_request(cmd.request_id)
                self._needs_step = True  # the next step reports the aborted request and forgets it

    def _add(self, cmd: _Add) -> None:
        added = []
        try:
            for rid, prompt, params in cmd.items:
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
                if self.metrics is not None:
                    self.metrics.on_added(rid, len(prompt), cmd.arrival)
        except (ValueError, ImportError) as e:  # refused (ImportError: no llguidance); the engine runs on
            for rid in added:
                self.engine.abort_request(rid)
            self._needs_step = bool(added)
            cmd.done.set_exception(e)
            return
        cmd.done.set_result(None)

    def _post(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed: the server is going away
            pass


def now() -> float:
    """The clock that request arrival times use (seconds, monotonic)."""
    return time.perf_counter()
