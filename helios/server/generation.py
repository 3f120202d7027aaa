"""What every generation route does before encoding: prepare, admit, submit.

Routes decode their protocol (on the frontend pool), call `start`, which prepares the request
in one more frontend-pool call (Frontend.prepare), and hand the `Run` and their protocol's
encoder to the driver (helios/server/driver.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from helios.frontend.generate import ChoiceUpdate, Submission, Usage, new_request_id
from helios.frontend.inference import InferenceRequest
from helios.server.admission import Reservation
from helios.server.outcomes import Outcome
from helios.server.responses import HttpError
from helios.server.state import ServerState


@dataclass(eq=False)
class Run:
    """One admitted, submitted request."""

    state: ServerState
    submission: Submission
    reservation: Reservation
    admitted: float = field(default_factory=time.monotonic)
    _first_seen: bool = False

    @property
    def request(self) -> InferenceRequest:
        return self.submission.request

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.request_id}

    @property
    def model(self) -> str:
        """The loaded model's public id: generation objects identify it, whatever the request said."""
        return self.state.model.public_id

    def usage(self) -> Usage:
        return self.submission.usage()

    def updates(self) -> AsyncIterator[ChoiceUpdate]:
        return self.state.runner.merged(self.submission.generations)

    def first_output(self) -> None:
        """Record time-to-first-answer once (metrics' first_response window)."""
        if not self._first_seen:
            self._first_seen = True
            self.state.first_response.record(time.monotonic() - self.admitted)

    def abort(self) -> None:
        """Abort every child the engine may still be running."""
        self.state.runner.abort(self.submission.generations)

    def end(self, outcome: Outcome | None) -> None:
        """The request is over: its admission slots go back and its outcome is counted (None: the
        client left first). The driver calls it once, however the run ends."""
        self.reservation.release()
        if outcome is not None:
            self.state.outcomes.record(outcome)


def admit(state: ServerState, slots: int) -> Reservation:
    """One HTTP admission slot per choice, or 429 (400 when the group can never be admitted)."""
    if slots > state.slots.capacity:
        raise HttpError(
            400,
            f"the request needs {slots} admission slots (one per choice) but the server has "
            f"{state.slots.capacity} ([server] http_slots): send fewer prompts or a smaller n",
        )
    reservation = state.slots.reserve(slots)
    if reservation is None:
        raise HttpError(429, "all HTTP admission slots are in use; retry later")
    return reservation


async def start(state: ServerState, request: InferenceRequest, prefix: str) -> Run:
    """Prepare (one frontend-pool hop), take one admission slot per choice (429 when none), submit.

    Admission refusals (an oversized group, no slot, a request the engine can never run, a full
    queue or a paused engine) are failed requests; frontend validation failures are not."""
    choices, limit = request.n * len(request.inputs), state.config.max_concurrency
    if choices > limit:  # before any prompt is tokenized: this group can never run
        state.outcomes.record(Outcome.FAILED)
        raise HttpError(
            400,
            f"the request asks for {choices} choices (prompts times n) but this server generates at "
            f"most {limit} at once ([server] max_concurrency): send fewer prompts or a smaller n",
        )
    prepared = await state.in_pool(state.frontend.prepare, request, new_request_id(prefix))
    with state.outcomes.failures():
        reservation = admit(state, prepared.num_choices)
        try:
            submission = state.runner.submit(prepared)
        except BaseException:
            reservation.release()
            raise
    return Run(state, submission, reservation)
