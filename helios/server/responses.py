"""Response helpers shared by the routes: JSON bodies, OpenAI-shaped errors, failure mapping."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Response

from helios.core.logs import log_failure
from helios.engine import EngineUnavailable, QueueFull, RequestRejected
from helios.frontend.inference import RequestError
from helios.protocols.encoding import OutputValidationError
from helios.protocols.errors import openai_error

log = logging.getLogger("helios.server")
JSON = "application/json"


class HttpError(Exception):
    """An error response in the OpenAI shape (the default for every route but Messages)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.param = param  # the offending field, for callers and logs; the wire says null (spec)
        self.type = type  # None: derived from the status


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=msgspec.json.encode(body), status_code=status, media_type=JSON, headers=headers or {})


def error_response(exc: HttpError) -> Response:
    body = openai_error(exc.status, exc.message, code=exc.code, type=exc.type)
    return json_response(body, exc.status, exc.headers)


def translate(exc: Exception) -> HttpError:
    """Map frontend/engine failures onto HTTP statuses (spec: Transport and admission)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RequestError):
        # The wire's param is null (spec), so the message is where a client finds the field.
        message = (
            exc.message if not exc.param or exc.param in exc.message else f"{exc.message} (parameter: {exc.param})"
        )
        return HttpError(400, message, param=exc.param, code=exc.code)
    if isinstance(exc, OutputValidationError):
        return HttpError(500, exc.message)
    if isinstance(exc, RequestRejected):
        return HttpError(400, str(exc))
    if isinstance(exc, QueueFull):
        return HttpError(503, f"{exc}; retry later")
    if isinstance(exc, EngineUnavailable):
        return HttpError(503, f"the model runtime is unavailable: {exc}")
    log_failure(log, "internal error", exc)
    return HttpError(500, f"internal server error: {type(exc).__name__}: {exc}")
