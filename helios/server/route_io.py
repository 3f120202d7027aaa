"""Request plumbing every route shares: server state, key checks, bounded JSON bodies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from litestar import Request, Response

from helios.server.auth import check_key
from helios.server.body import BodyError, read_body
from helios.server.json_body import JsonBodyError, parse_json
from helios.server.responses import HttpError, error_response
from helios.server.state import REQUEST_BYTES, ServerState

T = TypeVar("T")
log = logging.getLogger("helios.server")
LIST_FIELDS = ("messages", "input", "tools", "system")  # a Completions "prompt" batch: see generation.start
LARGE_JSON_BYTES = 1 << 16  # bodies past this are parsed in the frontend pool, off the event loop


def state_of(request: Request) -> ServerState:
    return request.app.state.helios


def authorize(request: Request, anthropic: bool = False) -> None:
    """Bearer auth; Anthropic routes also take x-api-key (both present: both must match). 401 on failure."""
    x_api_key = request.headers.get("x-api-key") if anthropic else None
    problem = check_key(
        state_of(request).config.api_key, request.headers.get("authorization"), x_api_key, allow_x_api_key=anthropic
    )
    if problem is not None:
        raise HttpError(401, problem)


def refusal(request: Request) -> Response | None:
    """The 401 response (OpenAI format) of a request without the serving key; None when it may pass."""
    try:
        authorize(request)
    except HttpError as exc:
        return error_response(exc)
    return None


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object (generation routes), its lists bounded by the context."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    limit = state_of(request).frontend.max_model_len
    for name in LIST_FIELDS:  # each item costs at least one token: a longer list can never fit
        value = body.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise HttpError(
                400,
                f"{name} has {len(value)} items; each costs at least a token and the context holds "
                f"{limit} (parameter: {name})",
            )
    return body


async def read_json(request: Request, *, compressed: bool = True) -> Any:
    """The decoded JSON body, bounded by max_body_bytes; any JSON value (callers check the shape).

    compressed=False refuses every Content-Encoding but identity with 415.
    """
    state = state_of(request)
    raw = await read_bytes(request, compressed=compressed)
    try:
        if len(raw) > LARGE_JSON_BYTES:
            return await state.in_pool(parse_json, raw)
        return parse_json(raw)
    except JsonBodyError as exc:
        raise HttpError(400, str(exc)) from None


async def read_bytes(request: Request, *, compressed: bool = True) -> bytes:
    """The (decoded) body bytes, bounded by max_body_bytes and body_timeout_seconds."""
    state = state_of(request)
    encoding = request.headers.get("content-encoding")
    if not compressed and (encoding or "identity").strip().lower() not in ("", "identity"):
        raise HttpError(415, f"Unsupported Content-Encoding {encoding.strip()!r}: this route accepts identity only")
    try:
        raw = await read_body(
            request.stream(), encoding, state.config.max_body_bytes, state.pool, state.config.body_timeout_seconds
        )
    except BodyError as exc:
        raise HttpError(exc.status, exc.message) from None
    REQUEST_BYTES.set(len(raw))  # the request's frontend work is charged by its size (ServerState.in_pool)
    return raw


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; its work was cancelled."""


def gone() -> Response:
    """The answer to a client that has left (nobody reads it)."""
    return Response(content=b"", status_code=499)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run a handler's work, cancelling it (ClientDisconnected) when the client disconnects first.

    Call after the body is read: from then on the only message the server sends is the
    disconnect. Cancelling the work closes its engine streams, which aborts the request.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        log.info("client disconnected; request cancelled")
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
