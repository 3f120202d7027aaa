"""JSON error bodies for the two error dialects: OpenAI routes and Anthropic Messages.

Types follow the status (api.md, Transport and admission); callers override where a route
needs a specific one. 415 uses invalid_request_error: OpenAI has no dedicated media-type
error and reports every malformed request under that type. OpenAI-shaped bodies always
carry "param": null, as the spec's error shape says; messages name the offending field.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def anthropic_type(status: int) -> str:
    if status >= 500:  # the spec maps all 5xx (503 included) to api_error on Messages
        return "api_error"
    return _TYPES.get(status, "invalid_request_error")


def openai_error(status: int, message: str, *, code: str | None = None, type: str | None = None) -> dict[str, Any]:
    """{"error": {"type", "message", "param": null, "code"}}; e.g. 404 with code="model_not_found"."""
    return {"error": {"type": type or openai_type(status), "message": message, "param": None, "code": code}}


def anthropic_error(status: int, message: str, type: str | None = None) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}} as the Messages API returns it."""
    return {"type": "error", "error": {"type": type or anthropic_type(status), "message": message}}
