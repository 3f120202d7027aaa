"""Which of a request's candidate prefix boundaries a hybrid core snapshots, and at what cost.

The frontend hints where a prompt's structure makes a prefix worth keeping (the conversation
anchor, message ends, Anthropic cache_control block ends). A snapshot there ends a prefill
chunk early (one more step) and copies the recurrent state, so each hint's extra work is
predicted from measured step costs and charged against a per-request allowance, a fraction
of the request's own predicted prefill time. Hints stay advisory: they never reserve a slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Hint roles (EngineRequest.checkpoint_hints), in selection priority order. A cache_control
# boundary is counted under "message" unless it lands on the anchor's boundary.
HINT_ROLES = ("anchor", "cache_control", "message")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A selected snapshot boundary of one sequence."""

    boundary: int  # a page-aligned prompt position, 0 < boundary <= the prompt's last page boundary
    role: str  # the role its capture is counted under: "anchor" or "message"
    cost_ns: int  # predicted extra work, charged (flare_checkpoint_extra_work_nanoseconds_total) when captured


class StepCosts:
    """Measured costs the selection predicts from: a step takes about fixed_ns + token_ns * rows
    (a least-squares line over recent steps, older ones decaying), and copying recurrent state
    takes copy_ns_per_byte. Each is None until measured."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.copy_ns_per_byte: float | None = None

    def observe_step(self, rows: int, elapsed_ns: int) -> None:
        d = self.decay
        self._w, self._x, self._y = self._w * d + 1, self._x * d + rows, self._y * d + elapsed_ns
        self._xx, self._xy = self._xx * d + rows * rows, self._xy * d + rows * elapsed_ns

    def observe_copy(self, nbytes: int, elapsed_ns: int) -> None:
        if nbytes > 0:
            self.copy_ns_per_byte = elapsed_ns / nbytes

    def _line(self) -> tuple[float, float] | None:
        """(fixed_ns, token_ns), once steps of at least two different sizes were seen."""
        spread = self._w * self._xx - self._x * self._x
        if self._w <= 0 or spread <= 1e-9 * self._w * self._xx:
            return None
        slope = max(0.0, (self._w * self._xy - self._x * self._y) / spread)
        return max(0.0, (self._y - slope * self._x) / self._w), slope

    @property
    def fixed_ns(self) -> float | None:
        line = self._line()
        return line[0] if line is not None else None

    def prefill_ns(self, tokens: int, chunk: int) -> float | None:
        """Predicted time to prefill `tokens` in chunks of `chunk`."""
        line = self._line()
        if line is None:
            return None
        return -(-tokens // max(chunk, 1)) * line[0] + tokens * line[1]

    def capture_ns(self, state_bytes: int) -> float | None:
        """Predicted extra work of one capture off the planned chunk grid: a step more, and the copy."""
        fixed = self.fixed_ns
        if fixed is None or self.copy_ns_per_byte is None:
            return None
        return fixed + state_bytes * self.copy_ns_per_byte


def select(
    hints: Iterable[tuple[int, str]],
    *,
    page_tokens: int,
    computed: int,
    last: int,
    planned: Callable[[int], bool],
    exists: Callable[[int], bool],
    capture_ns: float | None,
    allowance_ns: float | None,
) -> tuple[list[Checkpoint], list[str]]:
    """(selected checkpoints, skip reasons) for one sequence's hints.

    Each hint is floored to its page boundary (snapshots are keyed by page-hash chains); those
    at or before `computed`, past `last`, or already `exists`-ing need nothing. A boundary the
    scheduler stops at anyway (`planned`: interval and last-boundary snapshots) costs nothing
    extra; any other costs `capture_ns` (None: unknown_cost) within `allowance_ns` (work_budget).
    The anchor comes first, then cache_control marks in request order, then message ends from
    the latest back (the longest prefixes first)."""
    order = {role: rank for rank, role in enumerate(HINT_ROLES)}
    ranked = sorted((h for h in hints if h[1] in order), key=lambda h: (order[h[1]], -h[0] if h[1] == "message" else 0))
    chosen: dict[int, Checkpoint] = {}
    skips: list[str] = []
    spent = 0.0
    for position, role in ranked:
        boundary = position // page_tokens * page_tokens
        if boundary in chosen or boundary <= computed or boundary > last or exists(boundary):
            continue
        counted = "anchor" if role == "anchor" else "message"
        if planned(boundary):
            chosen[boundary] = Checkpoint(boundary, counted, 0)
            continue
        if capture_ns is None or allowance_ns is None:
            skips.append("unknown_cost")
            continue
        if spent + capture_ns > allowance_ns:
            skips.append("work_budget")
            continue
        spent += capture_ns
        chosen[boundary] = Checkpoint(boundary, counted, round(capture_ns))
    return sorted(chosen.values(), key=lambda c: c.boundary), skips
