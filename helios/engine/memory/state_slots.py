"""Recurrent-state slot accounting for hybrid cores (slot ids only, no tensors).

A hybrid model's recurrent layers (Mamba-2, gated DeltaNet) keep fixed-size per-sequence
state instead of per-token KV, so KV pages alone cannot resume them. The state tensors
have `num_live + num_snapshots` slots:

  live      one per running sequence (allocated at admission or fork, freed at finish,
            abort and preemption); never more than max_concurrency are in use, so the
            scheduler's concurrency check is also the slot check. `num_spare` more live slots
            are lent for one step at a time to speculating sequences (`borrow`): the step's
            rollback copy, the state before a verification step whose drafts may be rejected
  snapshot  an immutable copy of a sequence's state at a page-aligned prefix boundary,
            keyed by the page-hash chain up to that boundary (token content plus the
            identity slot), least-recently-used first out; conversation anchors (the end
            of a system/tools block every conversation with it shares) go out last while
            they hold at most half of the snapshot slots

Anchor guards: `anchor_guards` of the snapshot slots are kept for conversation anchors.
A capture of any other role takes a free slot only while more slots are free than guards
are unused, and otherwise evicts an older snapshot, so a run of message or interval
captures cannot leave a new conversation's anchor without a slot. A guard is in use when
an anchor snapshot holds it or an anchor capture is armed to land in it (its step not
yet run); `unused_guards` counts the rest (flare_checkpoint_anchor_reservations). Anchors
whose snapshots the host store is copying still hold their guards.

Prefix reuse for a hybrid restores a snapshot into the sequence's live slot; a prefix with
no snapshot is recomputed. A snapshot is taken by copying a live slot after the step whose
chunk ended at its boundary; it is registered only once that step succeeded, so a lookup
never returns a slot whose copy has not happened. A snapshot the host store's copier is reading
is pinned: no claim evicts it until the engine unpins it at a step boundary.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StatePool:
    def __init__(self, num_live: int, num_snapshots: int, anchor_guards: int | None = None, num_spare: int = 0) -> None:
        self.num_sequences = num_live  # live slots sequences may hold at once
        self.num_live = num_live + num_spare
        self.num_snapshots = num_snapshots
        self.anchor_guards = min(num_snapshots, num_snapshots // 4 if anchor_guards is None else anchor_guards)
        self._free_live: deque[int] = deque(range(self.num_live))
        self._free_snapshots: deque[int] = deque(range(self.num_live, self.num_live + num_snapshots))
        self._borrowed = 0  # live slots lent for a step (borrow), not yet given back
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # registered snapshots, oldest first
        self._pending: set[int] = set()  # snapshot slots whose copy a planned step will make
        self._armed: set[int] = set()  # of those, the slots anchor captures will land in
        self._anchors: set[bytes] = set()  # registered snapshots that are conversation anchors
        self._pinned: set[int] = set()  # registered snapshot slots being copied to the host store

    @property
    def num_slots(self) -> int:
        return self.num_live + self.num_snapshots

    @property
    def live_in_use(self) -> int:
        return self.num_live - len(self._free_live)

    @property
    def num_free(self) -> int:
        """Live and snapshot slots holding nothing."""
        return len(self._free_live) + len(self._free_snapshots)

    @property
    def snapshots_held(self) -> int:
        return len(self._by_hash)

    # ------------------------------------------------------------------ live slots
    def allocate(self) -> int:
        assert self._free_live, "no live state slot left (admission must stay within max_concurrency)"
        return self._free_live.popleft()

    def release(self, slot: int | None) -> None:
        if slot is not None:
            assert slot < self.num_live and slot not in self._free_live, f"state slot {slot} released twice"
            self._free_live.append(slot)

    @property
    def can_borrow(self) -> bool:
        return len(self._free_live) > self.num_sequences - (self.live_in_use - self._borrowed)

    def borrow(self) -> int | None:
        """A live slot lent for one step (a rollback copy), never one a sequence may still need: None
        when every free slot is owed to the sequences max_concurrency allows."""
        if not self.can_borrow:
            return None
        self._borrowed += 1
        return self._free_live.popleft()

    def give_back(self, slot: int) -> None:
        """End a loan: `slot` is the borrowed one, or the slot it replaced as a sequence's live slot."""
        assert self._borrowed > 0, "giving back a slot that was not borrowed"
        self._borrowed -= 1
        self.release(slot)

    @property
    def num_borrowed(self) -> int:
        return self._borrowed

    # ------------------------------------------------------------------ snapshots
    def lookup(self, chain: list[bytes]) -> tuple[int, int] | None:
        """(pages, snapshot slot) of the longest prefix of the chain with a snapshot, or None."""
        for pages in range(len(chain), 0, -1):
            slot = self._by_hash.get(chain[pages - 1])
            if slot is not None:
                self._by_hash.move_to_end(chain[pages - 1])
                return pages, slot
        return None

    def has(self, digest: bytes) -> bool:
        return digest in self._by_hash

    @property
    def unused_guards(self) -> int:
        """Anchor guards no anchor snapshot holds and no armed anchor capture will fill."""
        return max(0, self.anchor_guards - len(self._anchors) - len(self._armed))

    def claim(self, anchor: bool = False) -> int | None:
        """A snapshot slot for a capture a step will make: a free one (for other roles, only one
        beyond the unused anchor guards), else the oldest snapshot's."""
        if self._free_snapshots and (anchor or len(self._free_snapshots) > self.unused_guards):
            slot = self._free_snapshots.popleft()
        else:
            victim = self._victim()
            if victim is None:
                return None  # every snapshot slot is claimed by captures in flight, pinned or guarded
            slot = self._by_hash.pop(victim)
        self._pending.add(slot)
        if anchor:
            self._armed.add(slot)
        return slot

    def _victim(self) -> bytes | None:
        """The snapshot a claim evicts: the least recently used unpinned one, sparing anchors while
        they hold at most half of the slots."""
        candidates = [d for d, slot in self._by_hash.items() if slot not in self._pinned]
        if not candidates:
            return None
        victim = candidates[0]
        if len(self._anchors) <= self.num_snapshots // 2:
            victim = next((d for d in candidates if d not in self._anchors), victim)
        self._anchors.discard(victim)
        return victim

    def pin(self, digest: bytes) -> int:
        """The registered snapshot's slot, kept from eviction until unpin (a host-store copy)."""
        slot = self._by_hash[digest]
        assert slot not in self._pinned, f"snapshot slot {slot} pinned twice"
        self._pinned.add(slot)
        return slot

    def unpin(self, slot: int) -> None:
        self._pinned.remove(slot)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def drop_snapshots(self) -> int:
        """Forget every registered snapshot no host-store copy is reading (POST /flush_cache): their
        slots are free again. Returns the count dropped."""
        dropped = [digest for digest, slot in self._by_hash.items() if slot not in self._pinned]
        for digest in dropped:
            self._free_snapshots.append(self._by_hash.pop(digest))
            self._anchors.discard(digest)
        return len(dropped)

    def register(self, digest: bytes, slot: int, anchor: bool = False) -> None:
        """The claimed slot now holds the state at `digest`'s boundary."""
        self._pending.discard(slot)
        self._armed.discard(slot)
        if digest in self._by_hash:  # an identical snapshot landed first: keep that one
            self._free_snapshots.append(slot)
            return
        self._by_hash[digest] = slot
        if anchor:
            self._anchors.add(digest)

    def unclaim(self, slot: int) -> None:
        """A claimed capture that will not be registered (its step failed, its sequence left)."""
        self._pending.discard(slot)
        self._armed.discard(slot)
        self._free_snapshots.append(slot)

    def check(self, live_held: int) -> None:
        """Slots add up (tests): `live_held` running sequences hold one live slot each."""
        assert self.live_in_use == live_held + self._borrowed, (
            f"{self.live_in_use} live state slots in use, {live_held} held and {self._borrowed} borrowed"
        )
        held = len(self._free_snapshots) + len(self._by_hash) + len(self._pending)
        assert held == self.num_snapshots, "snapshot slots leaked"
        assert self._anchors <= self._by_hash.keys(), "an anchor outlived its snapshot"
        assert self._pinned <= set(self._by_hash.values()), "a pinned slot is not a registered snapshot"
        assert self._armed <= self._pending, "an armed anchor slot is not claimed"
