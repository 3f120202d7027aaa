"""Requests by the outcome their client sees: api.md's completed and failed metrics.

A request is counted once, whatever its choices do: completed when its answer went out whole
(a string-stopped answer included), failed when admission refused it (429, 503, or 400 for a
group that can never run), or its generation, grammar, tool policy or output validation failed
(HTTP 500, or a terminal error event on a stream). A request whose client left first, or that
frontend validation rejected before admission, counts neither. The decisions are made where the
outcome is known (generation.start and the driver's end of a run, the scoring routes); this
recorder is the one count the /metrics snapshot reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum


class Outcome(Enum):
    COMPLETED = "completed"
    FAILED = "failed"


class RequestOutcomes:
    """Counters of finished requests by outcome (any thread)."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(Outcome, 0)
        self._lock = threading.Lock()

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def count(self, outcome: Outcome) -> int:
        return self._counts[outcome]

    @contextmanager
    def failures(self) -> Iterator[None]:
        """A failed request when the block raises (an admission refusal, a failed scoring read); a
        cancellation (the client left) is no outcome."""
        try:
            yield
        except Exception:
            self.record(Outcome.FAILED)
            raise
