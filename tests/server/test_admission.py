"""HTTP admission slots: all-or-nothing acquisition, idempotent release through a reservation."""

from __future__ import annotations

import pytest

from helios.server.admission import AdmissionSlots


def test_acquire_is_all_or_nothing() -> None:
    slots = AdmissionSlots(4)
    assert slots.try_acquire(3) and slots.in_use == 3
    assert not slots.try_acquire(2) and slots.in_use == 3
    assert slots.try_acquire() and slots.in_use == 4
    slots.release(4)
    assert slots.in_use == 0 and slots.capacity == 4
    assert not slots.try_acquire(5)  # an oversized group never fits


def test_reservation_releases_once() -> None:
    slots = AdmissionSlots(2)
    with slots.reserve(2) as held:  # type: ignore[union-attr]
        assert held.held and slots.reserve() is None
        held.release()
        assert slots.in_use == 0
    assert slots.in_use == 0  # the exit after an explicit release does not release again


def test_reservation_released_on_error() -> None:
    slots = AdmissionSlots(1)
    with pytest.raises(RuntimeError):
        with slots.reserve():  # type: ignore[union-attr]
            raise RuntimeError
    assert slots.in_use == 0


def test_invalid_counts() -> None:
    with pytest.raises(ValueError):
        AdmissionSlots(0)
    slots = AdmissionSlots(1)
    with pytest.raises(ValueError):
        slots.try_acquire(0)
    with pytest.raises(ValueError):
        slots.release()
