"""HTTP plumbing: bounded JSON body reading, the API-key check, and client-disconnect handling.

A request whose client goes away must abort its engine requests (and so free its KV pages) at
once, not at the next token: both the SSE stream and the non-streaming wait race the work against
the ASGI `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from blockdraft.server.errors import APIError, error_response

logger = logging.getLogger("blockdraft.server")
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready (no response can reach it)."""


async def read_json_object(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError(415): the Content-Type is not application/json (parameters such as
            `; charset=utf-8` allowed), or is missing, as vLLM refuses them; checked first.
        APIError(413): the body is larger than `max_bytes` (checked before and while reading).
        APIError(400): a bad Content-Length, invalid UTF-8, invalid JSON, NaN/Infinity, nesting
            too deep, lone surrogate escapes, or a JSON value that is not an object.
        ClientDisconnected: the client closed the connection before sending the whole body; its
            message says how many bytes came (of the Content-Length, when one was sent).
    """
    _check_json_media_type(request.headers.get("content-type"))
    body = await _read_body(request, max_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise APIError(400, "request body JSON is nested too deeply") from None
    if not isinstance(value, dict):
        kind = {type(None): "null", bool: "boolean", list: "array", str: "string", int: "number", float: "number"}
        raise APIError(400, f"request body must be a JSON object, got a JSON {kind.get(type(value), type(value).__name__)}")
    try:
        # json accepts "\ud800" escapes; such strings cannot be tokenized (nor logged) later.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains an invalid \\u escape (a lone UTF-16 surrogate)") from None
    except RecursionError:
        raise APIError(400, "request body JSON is nested too deeply") from None
    return value


def _check_json_media_type(content_type: str | None) -> None:
    """APIError(415) unless `content_type` (the header's value, None: none sent) is application/json."""
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json":
        return
    got = "no Content-Type header" if content_type is None else f"Content-Type {content_type[:100]!r}"
    raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json'; got {got}",
                   code="unsupported_media_type")


async def _read_body(request: Request, max_bytes: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, f"invalid Content-Length header {length[:20]!r}")
        if int(length) > max_bytes:
            raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:  # chunked bodies carry no Content-Length: count while reading
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # starlette's: the client left mid-body, as one that leaves mid-answer
        of = f" of {length}" if length is not None else ""
        raise ClientDisconnected(f"while sending the request body ({size}{of} bytes received)") from None
    if size == 0:
        raise APIError(400, "request body is empty; send a JSON object")
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body is larger than the server limit of {max_bytes} bytes (the server's "
                         f"--max-body-bytes); send a smaller body", code="request_too_large")


def _refuse_constant(name: str):
    raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raises APIError(401) unless `api_key` is None or the request carries `Bearer <api_key>`."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


class V1KeyCheck:
    """ASGI middleware: every /v1 path needs the API key, unknown ones included, so a client
    without the key learns nothing about the routes (401 before 404 / 405, as vLLM's check).

    Pure ASGI (not BaseHTTPMiddleware), so streamed responses and client disconnects pass through
    untouched. `on_error(401)` is called for each refusal (metrics).
    """

    def __init__(self, app, api_key: str | None, on_error: Callable[[int], None] | None = None) -> None:
        self.app, self.api_key, self.on_error = app, api_key, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if self.api_key is not None and scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            try:
                check_api_key(Request(scope), self.api_key)
            except APIError as e:
                if self.on_error is not None:
                    self.on_error(401)
                response = error_response(401, e.message, e.param, e.code, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Call after the body has been read (then the next ASGI message is the disconnect).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(Response):
    """Server-sent events from `events` (already-encoded `data: ...\\n\\n` frames).

    Ends when the events end or the client disconnects, whichever comes first; `on_close()` is
    called exactly once either way (it aborts whatever the stream was waiting for).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        # No super().__init__: it would declare Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sender, watcher):
                t.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            self._on_close()
        if sender.done() and not sender.cancelled() and sender.exception() is not None:
            exc = sender.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                logger.error("event stream failed: %r", exc, exc_info=exc)

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for frame in self._events:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        finally:
            await _close_quietly(self._events)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _close_quietly(gen) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            pass
