"""JSON errors: every refusal is ``{"error": {"message", "type", "code", "param"}}``.

One shape for every route, OpenAI's: clients of ``/v1/audio/speech`` already parse it, and
``/tts`` callers get the same clear message and a machine-readable ``code``.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

_LOGGER = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class HttpError(Exception):
    """A refused request: status code, message, a short code and the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, self.param, self.headers)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None
               ) -> dict[str, Any]:  # fmt: skip
    """The ``error`` object of a refusal (and of a streamed answer's ``error`` event)."""
    return {"message": message, "type": _TYPES.get(status, "error"), "code": code, "param": param}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": error_body(status, message, code, param)}
    return JSONResponse(body, status_code=status, headers=headers)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)
    # A refused request is the client's to fix (WARNING); a failure of ours is an ERROR.
    level = logging.ERROR if exc.status >= 500 and exc.status != 503 else logging.WARNING
    _LOGGER.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status,
                exc.message)  # fmt: skip
    return exc.response()


async def starlette_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 as JSON too (its default is plain text)."""
    assert isinstance(exc, HTTPException)
    message = exc.detail if exc.status_code != 404 else f"no route {request.url.path}"
    _LOGGER.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, message)
    return error_response(exc.status_code, str(message), headers=dict(exc.headers or {}))
