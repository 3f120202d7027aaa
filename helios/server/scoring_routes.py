"""POST /v1/systemone and POST /v1/decisions: decode, compile, read labels, encode.

Both routes share one scorer (helios/frontend/scoring.py). System One schema failures are
422 detail lists; every other failure uses the Chat Completions error format.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from litestar import Request, Response, post
from litestar.handlers import HTTPRouteHandler

from helios.frontend.generate import new_request_id
from helios.frontend.scoring import LabelRead, QuestionSpec, ScoringUsage, compile_questions, read_labels
from helios.protocols import decisions, systemone
from helios.server import multipart
from helios.server.generation import admit as _admit
from helios.server.json_body import JsonBodyError, parse_json
from helios.server.outcomes import Outcome
from helios.server.responses import HttpError, error_response, json_response, translate
from helios.server.route_io import (
    ClientDisconnected,
    authorize,
    gone,
    read_bytes,
    read_json,
    state_of,
    unless_disconnected,
)
from helios.server.state import ServerState

TEXT_ONLY = "this model is text-only (its core has no vision program): image assets need a vision core"


def _multipart(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data"


def _check_assets(request: Request, has_assets: bool) -> None:
    """Images need TypeSafe-Danger-Zone-Images: true and a vision core."""
    if not has_assets:
        return
    if request.headers.get(systemone.ASSETS_HEADER, "").strip().lower() != "true":
        raise HttpError(400, "image assets require the TypeSafe-Danger-Zone-Images: true header and a vision core")
    if state_of(request).frontend.vision is None:
        raise HttpError(400, TEXT_ONLY)


async def _body(request: Request) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return body


async def _multipart_body(request: Request) -> tuple[dict, dict[str, bytes]]:
    """(the application/json request part, the remaining parts' bytes by unique name). Only an
    identity body: compressed multipart is a 415 (JSON bodies keep the usual encodings)."""
    encoding = (request.headers.get("content-encoding") or "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise HttpError(415, "multipart/form-data bodies must not be compressed (Content-Encoding: identity)")
    _check_assets(request, True)
    raw = await read_bytes(request, compressed=False)
    try:
        parts = multipart.parse(raw, request.headers.get("content-type", ""))
    except multipart.MultipartError as exc:
        raise HttpError(400, str(exc)) from None
    if not parts or parts[0].content_type != "application/json":
        raise HttpError(400, "the first multipart part must be the application/json request")
    try:
        body = parse_json(parts[0].data)
    except JsonBodyError as exc:
        raise HttpError(400, f"the application/json part: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the application/json part must be a JSON object")
    images: dict[str, bytes] = {}
    for part in parts[1:]:
        if part.name in images or part.name == parts[0].name:
            raise HttpError(400, f"multipart part name {part.name!r} is used twice; image parts need unique names")
        images[part.name] = part.data
    return body, images


class _Submission:
    """A scoring request's id, and whether it reached model submission: from then on every
    response carries x-request-id, errors included (api.md, errors)."""

    def __init__(self, prefix: str) -> None:
        self.request_id = new_request_id(prefix)
        self.submitted = False

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.request_id} if self.submitted else {}

    def failed(self, exc: Exception) -> Response:
        error = translate(exc)
        error.headers = {**error.headers, **self.headers}
        return error_response(error)


async def _score(
    state: ServerState, text: str, questions: Sequence[tuple[str, QuestionSpec]], submission: _Submission
) -> tuple[list[LabelRead], ScoringUsage]:
    """Compile off the event loop, then hold one admission slot while the questions run in turn.
    From admission on the request is counted: failed when refused or when a read fails, else completed."""
    compiled = await state.in_pool(compile_questions, state.frontend, text, questions)
    with state.outcomes.failures():
        reservation = _admit(state, 1)
        submission.submitted = True
        try:
            result = await read_labels(state.frontend, state.runner, compiled, submission.request_id)
        finally:
            reservation.release()
    state.outcomes.record(Outcome.COMPLETED)
    return result


ScoringAnswer = Callable[[Request, _Submission], Awaitable[Response]]


def _scoring_route(path: str, id_prefix: str) -> Callable[[ScoringAnswer], HTTPRouteHandler]:
    """The POST route at `path` around a scoring answer: the key is checked first; System One
    schema failures are 422 detail lists, every other failure a Chat Completions-style error."""

    def route_of(answer: ScoringAnswer) -> HTTPRouteHandler:
        async def route(request: Request) -> Response:
            submission = _Submission(id_prefix)
            try:
                authorize(request)
                return await answer(request, submission)
            except systemone.SchemaError as exc:
                return json_response(exc.body(), 422)
            except ClientDisconnected:
                return gone()
            except Exception as exc:  # noqa: BLE001 - every other failure is a Chat Completions-style error
                return submission.failed(exc)

        return post(path, status_code=200)(route)

    return route_of


@_scoring_route("/v1/systemone", "sysone")
async def systemone_route(request: Request, submission: _Submission) -> Response:
    if _multipart(request):
        body, parts = await _multipart_body(request)
    else:
        body, parts = await _body(request), {}
    _check_assets(request, systemone.uses_assets(body))
    state = state_of(request)
    assets = systemone.decode_assets(body, parts)
    decoded = systemone.decode(body, assets)
    questions = [(f"questions.{q.key}", q.spec) for q in decoded.questions]
    reads, usage = await unless_disconnected(request, _score(state, decoded.state, questions, submission))
    body_out = systemone.response(state.model.public_id, decoded, reads, usage)
    return json_response(body_out, headers=submission.headers)


@_scoring_route("/v1/decisions", "decision")
async def decisions_route(request: Request, submission: _Submission) -> Response:
    if _multipart(request):
        raise HttpError(400, "multipart/form-data is not supported on /v1/decisions (text input only)")
    decoded = decisions.decode(await _body(request))
    state = state_of(request)
    questions = [(f"questions.{i}", q.spec) for i, q in enumerate(decoded.questions)]
    reads, usage = await unless_disconnected(request, _score(state, decoded.text, questions, submission))
    body_out = decisions.response(state.model.public_id, decoded, reads, usage)
    return json_response(body_out, headers=submission.headers)
