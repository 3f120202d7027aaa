"""A value computed once per step and reused by every layer of that step (plans, checks)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from torch import Tensor

T = TypeVar("T")


class StepMemo(Generic[T]):
    """Remembers one value computed for the step whose input tensors are alive right now.

    Keyed by the identity of the step's input tensors: the executor creates them fresh
    every step, and a weak reference tells a dead step's tensor from a new one that
    happens to reuse its id.
    """

    def __init__(self) -> None:
        self._keys: tuple[weakref.ref, ...] = ()
        self._value: T | None = None

    def get(self, tensors: tuple[Tensor, ...], build: Callable[[], T]) -> T:
        if (
            self._value is not None
            and len(self._keys) == len(tensors)
            and all(ref() is t for ref, t in zip(self._keys, tensors))
        ):
            return self._value
        self._value = build()
        self._keys = tuple(weakref.ref(t) for t in tensors)
        return self._value
