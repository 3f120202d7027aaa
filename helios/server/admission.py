"""HTTP admission slots: one per generated choice, 429 when exhausted.

Slots are counted under a lock, so acquiring on the event loop and releasing from a worker
thread (a finished stream's callback) is safe; no call ever blocks for long.
"""

from __future__ import annotations

import threading
from types import TracebackType


class AdmissionSlots:
    """A counting limit that never waits: try_acquire either takes n slots or takes none."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_use(self) -> int:
        return self._in_use

    def try_acquire(self, n: int = 1) -> bool:
        """Take n slots at once if all are free; groups larger than capacity never fit."""
        if n < 1:
            raise ValueError(f"slot count must be positive, got {n}")
        with self._lock:
            if self._in_use + n > self._capacity:
                return False
            self._in_use += n
            return True

    def release(self, n: int = 1) -> None:
        with self._lock:
            if n < 1 or n > self._in_use:
                raise ValueError(f"releasing {n} slots with {self._in_use} in use")
            self._in_use -= n

    def reserve(self, n: int = 1) -> Reservation | None:
        """A held reservation (a context manager releasing once), or None when full."""
        return Reservation(self, n) if self.try_acquire(n) else None


class Reservation:
    """n acquired slots; release() is idempotent so every exit path may call it."""

    def __init__(self, slots: AdmissionSlots, n: int) -> None:
        self._slots, self.n = slots, n
        self._held = True
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._slots.release(self.n)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
