"""Recurrent-state planning for hybrid cores: where a sequence's state is snapshotted, which
snapshot its prefix resumes from, endpoint snapshots of decoding sequences, and the rollback
slot a drafting sequence borrows for one step (state_slots.py keeps the slot accounting).

Prefill chunks end at snapshot boundaries so the state there can be captured: multiples of the
snapshot interval, the prompt's last page boundary, and the request's checkpoint hints chosen at
first admission under its work allowance (checkpoints.py). A capture is a copy after the step
into a claimed slot, registered once the step ran. Drafts stop short of the next page boundary,
so a rewind after a rejected draft never crosses a published page or a planned snapshot.
"""

from __future__ import annotations

from helios.engine.memory.chains import chain_of, digest_at
from helios.engine.memory.checkpoints import StepCosts, select
from helios.engine.memory.plan import Capture, MemoryPlan, PlanBuilder
from helios.engine.memory.state_slots import StatePool
from helios.engine.request import EngineStats
from helios.engine.sequence import Sequence


class Snapshots:
    def __init__(
        self,
        states: StatePool,
        page_tokens: int,
        stats: EngineStats,
        costs: StepCosts,
        interval: int,
        work_fraction: float,
        prefill_chunk_size: int,
        plan: PlanBuilder,
    ) -> None:
        self.states = states
        self.page_tokens = page_tokens
        self.stats = stats
        self.costs = costs  # measured by the engine: what hinted checkpoints are predicted to cost
        self.interval = interval  # a multiple of the page size; 0: only the prompt's last page boundary
        self.work_fraction = work_fraction  # of a request's predicted prefill time, spent on hinted captures
        self.prefill_chunk_size = prefill_chunk_size
        self.plan = plan

    # ------------------------------------------------------------------ boundaries
    def last_boundary(self, seq: Sequence) -> int:
        """The prompt's last page boundary before its final token (the longest prefix reusable later)."""
        return (seq.num_prompt - 1) // self.page_tokens * self.page_tokens

    def next_boundary(self, seq: Sequence) -> int | None:
        """The next prompt position after num_computed where seq's state is snapshotted: a multiple
        of the snapshot interval, a chosen checkpoint, or the prompt's last page boundary (at least
        one token is always computed, so never the prompt's end)."""
        last = self.last_boundary(seq)
        if last <= seq.num_computed:
            return None
        following = (seq.num_computed // self.interval + 1) * self.interval if self.interval else last
        hinted = min((b for b in seq.checkpoints if b > seq.num_computed), default=last)
        return min(following, hinted, last)

    def planned(self, seq: Sequence, boundary: int) -> bool:
        """Whether seq is snapshotted at this page boundary without any hint (no extra chunk)."""
        return boundary == self.last_boundary(seq) or bool(self.interval and boundary % self.interval == 0)

    def choose(self, seq: Sequence, computed: int) -> None:
        """At first admission, resuming after `computed` tokens: which of the request's hints seq
        snapshots (checkpoints.py)."""
        if not self.states.num_snapshots or not seq.request.checkpoint_hints:
            return
        prefill = self.costs.prefill_ns(seq.num_prompt - computed, self.prefill_chunk_size)
        chosen, skips = select(
            seq.request.checkpoint_hints,
            page_tokens=self.page_tokens,
            computed=computed,
            last=self.last_boundary(seq),
            planned=lambda b: self.planned(seq, b),
            exists=lambda b: self.states.has(digest_at(seq, b, self.page_tokens)),
            capture_ns=self.costs.capture_ns(self.stats.state_slot_bytes),
            allowance_ns=prefill * self.work_fraction if prefill is not None else None,
        )
        seq.checkpoints = {c.boundary: c for c in chosen}
        for reason in skips:
            self.stats.count_checkpoint_skip(reason)

    # ------------------------------------------------------------------ captures
    def cut(self, seq: Sequence, end: int) -> int:
        """A prefill chunk's end, moved back to the next snapshot boundary it would pass; a chunk
        ending on that boundary plans its capture."""
        if not self.states.num_snapshots:
            return end
        boundary = self.next_boundary(seq)
        if boundary is not None and boundary < end:
            end = boundary
        if end == boundary:
            self._capture(seq, boundary)
        return end

    def _capture(self, seq: Sequence, boundary: int) -> None:
        """Plan a copy of seq's state after this step into a snapshot slot for `boundary`."""
        assert seq.state_slot is not None
        digest = digest_at(seq, boundary, self.page_tokens)
        if self.states.has(digest):
            return
        chosen = seq.checkpoints.get(boundary)
        anchor = chosen is not None and chosen.role == "anchor"
        slot = self.states.claim(anchor)
        if slot is None:
            self.stats.count_checkpoint_skip("storage")
            return
        self.plan.state_after.append((seq.state_slot, slot))
        self.plan.captures.append(Capture(seq, digest, slot, anchor))
        if chosen is not None:
            self.stats.count_checkpoint_capture(chosen.role)
            self.stats.checkpoint_extra_work_ns += chosen.cost_ns
        elif boundary == self.last_boundary(seq):
            self.stats.count_checkpoint_capture("message")  # the last page boundary of the request's messages

    def follow_endpoint(self, seq: Sequence) -> None:
        """Exact endpoint capture for a decoding sequence: after a step that ends on a page boundary,
        its state is copied into the sequence's own (unregistered) endpoint snapshot slot, so when it
        finishes, the next turn of its conversation resumes from its last full page instead of
        recomputing the answer. Registered at finish or preemption; a failed step's sequence returns
        the slot."""
        boundary = seq.num_computed + 1
        if boundary % self.page_tokens:
            return
        assert seq.state_slot is not None
        if seq.endpoint_slot is None:
            seq.endpoint_slot = self.states.claim()
            if seq.endpoint_slot is None:
                self.stats.count_checkpoint_skip("storage")
                return
        self.plan.state_after.append((seq.state_slot, seq.endpoint_slot))
        seq.endpoint_digest = digest_at(seq, boundary, self.page_tokens)

    def settle_endpoint(self, seq: Sequence, keep: bool) -> None:
        """Register (keep) or return the sequence's endpoint snapshot slot."""
        slot, digest = seq.endpoint_slot, seq.endpoint_digest
        seq.endpoint_slot, seq.endpoint_digest = None, None
        if slot is None:
            return
        if keep and digest is not None and not self.states.has(digest):
            self.states.register(digest, slot)
            self.stats.count_checkpoint_capture("endpoint")
        else:
            self.states.unclaim(slot)

    def step_ran(self, plan: MemoryPlan) -> None:
        """The step's copies were made: its captures hold their boundaries' state now."""
        for capture in plan.captures:
            self.states.register(capture.digest, capture.slot, capture.anchor)

    def step_failed(self, plan: MemoryPlan) -> None:
        for capture in plan.captures:
            self.states.unclaim(capture.slot)

    # ------------------------------------------------------------------ prefix reuse
    def reusable(self, seq: Sequence, num_pages: int) -> tuple[int, int | None]:
        """Of seq's first `num_pages` cached pages, how many its state can resume after (up to the
        longest boundary with a snapshot), and that snapshot's slot."""
        found = self.states.lookup(chain_of(seq, num_pages, self.page_tokens))
        return (found[0], found[1]) if found is not None else (0, None)

    def resume(self, seq: Sequence, snapshot: int | None, digest: bytes, payload: object | None) -> None:
        """Fill seq's live slot with the state at its reused prefix: a host record's payload (also
        written into a snapshot slot registered once the step ran, so the next request sharing the
        prefix resumes from the pool), else the pool's snapshot."""
        assert seq.state_slot is not None
        if payload is not None:
            self.plan.state_in.append((seq.state_slot, payload))
            slot = self.states.claim() if not self.states.has(digest) else None
            if slot is not None:
                self.plan.state_in.append((slot, payload))
                self.plan.captures.append(Capture(seq, digest, slot, False))
        elif snapshot is not None:
            self.plan.state_before.append((snapshot, seq.state_slot))

    # ------------------------------------------------------------------ drafting
    def draft_room(self, seq: Sequence) -> int:
        """Drafts seq may take: its round stays short of the next page boundary, and only while a
        spare slot is free for the rollback copy."""
        if not self.states.can_borrow:
            return 0
        boundary = (seq.num_computed // self.page_tokens + 1) * self.page_tokens
        return max(0, boundary - seq.num_computed - 2)

    def borrow(self, seq: Sequence) -> bool:
        """A rollback slot for seq's drafts this step: the state before them, copied before the step."""
        assert seq.state_slot is not None
        seq.rollback_slot = self.states.borrow()
        if seq.rollback_slot is None:
            return False
        self.plan.state_before.append((seq.state_slot, seq.rollback_slot))
        return True

    def settle_round(self, seq: Sequence, rejected: bool) -> bool:
        """End a round: give the borrowed slot back, or, when a draft was rejected (the live state
        absorbed it), make it the live slot. Whether seq must rewind to the round's first position."""
        if seq.rollback_slot is None:
            return False
        assert seq.state_slot is not None
        slot, seq.rollback_slot = seq.rollback_slot, None
        if rejected:
            slot, seq.state_slot = seq.state_slot, slot
            self.stats.state_rewinds += 1
        self.states.give_back(slot)
        return rejected

    # ------------------------------------------------------------------ slots
    def allocate(self, seq: Sequence) -> None:
        seq.state_slot = self.states.allocate()  # within max_concurrency, so a live slot is free

    def release(self, seq: Sequence) -> None:
        self.states.release(seq.state_slot)
        seq.state_slot = None
        if seq.rollback_slot is not None:
            self.states.give_back(seq.rollback_slot)
            seq.rollback_slot = None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child's live slot, holding the parent's state after this step."""
        assert parent.state_slot is not None
        child.state_slot = self.states.allocate()
        self.plan.state_after.append((parent.state_slot, child.state_slot))

    def check(self, running: list[Sequence], waiting: list[Sequence]) -> None:
        assert all(s.state_slot is not None for s in running), "a running sequence has no state slot"
        assert all(s.state_slot is None for s in waiting), "a waiting sequence holds a state slot"
        lent = sum(s.rollback_slot is not None for s in running)
        assert lent == self.states.num_borrowed, "a borrowed state slot is not held by a running sequence"
        self.states.check(len(running))
