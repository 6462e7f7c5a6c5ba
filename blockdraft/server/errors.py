"""API errors and their OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("blockdraft.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client: HTTP `status`, a message saying what to fix, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def model_not_found(asked: str, served: str) -> APIError:
    """404 for a model id this server does not serve."""
    return APIError(404, f"model '{asked[:100]}' does not exist; this server serves '{served}'", param="model", code="model_not_found")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object for `status`."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers=None) -> JSONResponse:
    """A JSONResponse with HTTP `status`, the OpenAI error object (error_body) and `headers`."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Answer every failure as OpenAI JSON. `on_error(status)` is called for each (metrics)."""

    def count(status: int) -> None:
        if on_error is not None:
            on_error(status)

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        count(exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status == 429:  # busy: the OpenAI client and proxies wait this long (s) before retrying
            headers = {"Retry-After": "1"}
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405) land here.
        count(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path[:200]}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        count(400)
        return error_response(400, f"invalid request: {exc.errors()[:1]}")

    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.error("internal error: %r", exc, exc_info=exc)
        count(500)
        return error_response(500, "internal server error (see the server log)")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
