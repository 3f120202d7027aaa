"""One step's memory work, planned by the memory manager and carried out by the executor.

Order on the device: host_in, state_before, state_in, then the step's programs, then
page_copies, window_copies and state_after. Captures are registered only after the step ran
(MemoryManager.step_ran); a failed step returns their slots (MemoryManager.step_failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from helios.engine.sequence import Sequence

Copy = tuple[int, int]  # (src, dst)


class Capture(NamedTuple):
    """A state snapshot a step makes: state_after copies a live slot into `slot`."""

    seq: Sequence  # the sequence whose state is copied
    digest: bytes  # the page-hash chain at the snapshot's boundary (its StatePool key)
    slot: int  # a claimed snapshot slot (StatePool.claim), registered once the step ran
    anchor: bool  # a conversation anchor (evicted last, holds an anchor guard)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One step's memory work, in the order the executor carries it out (this module's docstring)."""

    # Before the step.
    host_in: tuple[tuple[int, object], ...] = ()  # (page, payload) host-store restores; each page is the
    # admitting sequence's own fresh page, published already (a lookup may share it this step)
    state_before: tuple[Copy, ...] = ()  # state-slot copies: snapshot -> live slot restores, live -> borrowed
    # rollback slot of a drafting hybrid; every dst is a live slot nothing else writes this step
    state_in: tuple[tuple[int, object], ...] = ()  # (state slot, payload) host-store restores, after
    # state_before (a slot written here may have been a snapshot those copies read)
    # After the step (the copies read what it has just written).
    page_copies: tuple[Copy, ...] = ()  # forked children's partial pages: src the parent's, dst a page
    # drawn from the parent's reservation
    window_copies: tuple[Copy, ...] = ()  # the same in the window pool (window_pages.py)
    state_after: tuple[Copy, ...] = ()  # forks (parent live -> child live), captures and endpoint follows
    # (live -> claimed snapshot slot); every dst appears once
    captures: tuple[Capture, ...] = ()  # of state_after's (and state_in's) snapshot writes, those
    # registered under a digest once the step ran; endpoint follows are registered at their finish


NO_MEMORY_WORK = MemoryPlan()


@dataclass(slots=True)
class PlanBuilder:
    """The lists a step's planning appends to; `build` hands them over as one MemoryPlan."""

    host_in: list[tuple[int, object]] = field(default_factory=list)
    state_before: list[Copy] = field(default_factory=list)
    state_in: list[tuple[int, object]] = field(default_factory=list)
    page_copies: list[Copy] = field(default_factory=list)
    window_copies: list[Copy] = field(default_factory=list)
    state_after: list[Copy] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)

    def build(self) -> MemoryPlan:
        plan = MemoryPlan(
            tuple(self.host_in),
            tuple(self.state_before),
            tuple(self.state_in),
            tuple(self.page_copies),
            tuple(self.window_copies),
            tuple(self.state_after),
            tuple(self.captures),
        )
        for f in fields(self):
            getattr(self, f.name).clear()
        return plan
