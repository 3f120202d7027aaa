"""Host store copy-out: finished prefixes pinned in the pool for the copier thread, or deferred.

A finishing sequence's pages (and a hybrid's snapshots) that the host store lacks are pinned (a
pool reference, a snapshot pin) before its pages are released, within a bound on pinned bytes
(beyond it the chain's end is dropped, counted); the engine hands them to the copier after the
step (hand_off_copies) and the pins are released at a later step boundary once copied
(settle_copies). Pins are taken only when the pool keeps the headroom the next step may need;
otherwise the offer is deferred (counted) and retried at later step boundaries from the pool's
cached pages. Under pool pressure the memory manager calls reclaim: wait for the copier, release
every pin.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from helios.engine.memory.host_copy import Copier, CopyJob
from helios.engine.memory.host_store import HostStore, state_key
from helios.engine.memory.kv_cache import ROOT_HASH, PagePool
from helios.engine.memory.state_slots import StatePool
from helios.engine.sequence import Sequence

MAX_DEFERRED_OFFERS = 64  # copy-out offers kept for a retry while the pool lacks headroom


@dataclass(frozen=True, slots=True)
class _Offer:
    """A finished sequence's published chain, offered to the host store."""

    chain: tuple[bytes, ...]  # its full pages' chain hashes
    tokens: tuple[int, ...]  # the tokens of those pages (len(chain) * page_tokens)
    anchor: int  # pages of the chain that end at or before its conversation anchor


class CopyOut:
    """The memory manager's copy-out bookkeeping (it owns one; every call is on the engine thread)."""

    def __init__(
        self,
        pool: PagePool,
        states: StatePool | None,
        host: HostStore | None,
        copier: Copier | None,
        page_bytes: int,
        copy_queue_bytes: int,
        next_step_pages: Callable[[], int],
    ) -> None:
        self.pool = pool
        self.states = states
        self.host = host
        self.copier = copier  # reads pinned pages and snapshots into host records (host_copy.py)
        self.host_page_bytes = page_bytes  # bytes of one page's record payload
        self.host_state_bytes = copier.state_bytes if copier is not None else 0  # a state record's payload
        self.copy_queue_bytes = copy_queue_bytes  # bound on pinned bytes the copier has not released yet
        self._next_step_pages = next_step_pages
        self.host_out: list[CopyJob] = []  # pinned, not handed to the copier yet (the engine does after the step)
        self._copying: dict[bytes, CopyJob] = {}  # record digest -> its pinned job, until the pin is released
        self._copying_bytes = 0
        self._deferred: deque[_Offer] = deque()  # offers the headroom check deferred, oldest first

    def offer(self, seq: Sequence) -> None:
        """Offer seq's published chain to the host store (pinned for the copier, or deferred)."""
        if self.host is None or self.copier is None or not seq.chain:
            return
        size = self.pool.page_tokens
        offer = _Offer(tuple(seq.chain), tuple(seq.token_ids[: len(seq.chain) * size]), self._anchor_pages(seq))
        pages = seq.pages
        releasing = seq.reserved + sum(1 for page in pages if self.pool.ref_count[page] == 1)
        if not self._pin_offer(offer, lambda index: pages[index], owned=1, releasing=releasing):
            self._defer(offer)

    def _pin_offer(self, offer: _Offer, page_at, owned: int, releasing: int) -> bool:
        """Pin the offer's records the host store lacks (a hybrid's: up to each snapshot boundary on
        its chain, with that snapshot; the anchor's boundary first) for the copier, within the bound
        on pinned bytes; what does not fit, or is no longer in the pool, is dropped, counted as the
        chain's end. False, pinning nothing, when the pins would eat into the pool's headroom
        (_short_of_headroom): the offer is deferred instead of the engine later waiting for them.

        page_at(index): the pool page holding chain page `index`, or None; `owned`: references the
        offering sequence still holds on each of its pages (1 at its finish, 0 on a retry);
        `releasing`: pages that become available once the offering sequence releases its own."""
        assert self.host is not None
        chain, anchor = offer.chain, offer.anchor
        if self.states is None:
            ends = [len(chain)]
        else:
            ends = sorted(
                (i + 1 for i, digest in enumerate(chain) if self.states.has(digest)),
                key=lambda end: (end != anchor, end),
            )
        size, offered, held, dropped, skipped = self.pool.page_tokens, 0, [], 0, 0
        planned: list[tuple[bool, int, bytes, int, int | None]] = []  # (state, chain index, key, bytes, page)
        planned_bytes = 0
        for end in ends:
            candidates = [(False, i) for i in range(offered, end)] + (
                [(True, end - 1)] if self.states is not None else []
            )
            offered = max(offered, end)
            for state, index in candidates:
                digest = chain[index]
                key = state_key(digest) if state else digest
                if self.host.contains(key) or key in self._copying:
                    skipped += 1  # a duplicate, or a retry of what another offer holds already
                    if index < anchor and self.host.contains(key):
                        held.append(key)
                    continue
                nbytes = self.host_state_bytes if state else self.host_page_bytes
                page = None if state else page_at(index)
                gone = (state and not self.states.has(digest)) or (not state and page is None)  # type: ignore[union-attr]
                if dropped or gone or self._copying_bytes + planned_bytes + nbytes > self.copy_queue_bytes:
                    dropped += 1  # the copier is behind (or the pool lost the page): keep the chain's head
                    continue
                planned.append((state, index, key, nbytes, page))
                planned_bytes += nbytes
        cost = sum(1 for state, _, _, _, page in planned if not state and self.pool.ref_count[page] <= owned)
        if cost and self._short_of_headroom(cost, releasing):
            self.host.stats.copy_deferrals += 1
            return False
        for state, index, key, nbytes, page in planned:
            in_anchor = index < anchor
            if state:
                assert self.states is not None
                job = CopyJob(True, self.states.pin(chain[index]), key, chain[index], (), in_anchor)
            else:
                assert page is not None
                self.pool.share(page)
                parent = chain[index - 1] if index else ROOT_HASH
                job = CopyJob(False, page, key, parent, offer.tokens[index * size : (index + 1) * size], in_anchor)
            self._copying[key] = job
            self._copying_bytes += nbytes
            self.host_out.append(job)
        self.host.stats.skipped += skipped
        if held:
            self.host.mark_anchor(held)
        if dropped:
            self.host.stats.drop("dram", "end_of_chain", dropped)
        return True

    def _short_of_headroom(self, cost: int, releasing: int) -> bool:
        """Whether pinning `cost` more pages would leave the pool fewer available pages than the
        next step may need (the scheduler's count). Pinning anyway would make the engine wait for
        the copier (reclaim)."""
        return self.pool.num_available + releasing - cost < self._next_step_pages()

    def _defer(self, offer: _Offer) -> None:
        """Keep an offer the headroom check deferred, to retry at later step boundaries (the oldest
        beyond the bound is given up: its chain's records not yet held are dropped, end_of_chain)."""
        self._deferred.append(offer)
        if len(self._deferred) > MAX_DEFERRED_OFFERS:
            old = self._deferred.popleft()
            assert self.host is not None
            missing = sum(1 for digest in old.chain if not self.host.contains(digest))
            if missing:
                self.host.stats.drop("dram", "end_of_chain", missing)

    def _retry_deferred(self) -> None:
        """At a step boundary: pin the deferred offers that fit the headroom now, oldest first, from
        the pool's cached pages (a page evicted meanwhile ends its chain there)."""
        while self._deferred:
            if not self._pin_offer(self._deferred[0], self.pool.page_of, owned=0, releasing=0):
                return
            self._deferred.popleft()

    @property
    def checkpoint_slots(self) -> tuple[int, int, int]:
        """(in use, total, copy-out intake) slots of the local checkpoint pool, where a slot is a KV
        page or a recurrent-state slot: in use is every one not free (a live sequence's pages and
        state, cached prefix pages, snapshots held or claimed, and the pages and snapshots pinned
        for the copier); intake is how many page records the copy-out bound lets the copier hold
        pinned at once, drawn from the same pool."""
        pool, states = self.pool, self.states
        total, free = pool.num_pages, pool.num_free
        if states is not None:
            total += states.num_slots
            free += states.num_free
        intake = 0
        if self.copier is not None and self.host_page_bytes:
            intake = min(self.copy_queue_bytes // self.host_page_bytes, pool.num_pages)
        return total - free, total, intake

    @property
    def copies_deferred(self) -> int:
        """Copy-out offers the headroom check deferred, waiting for a retry."""
        return len(self._deferred)

    def _anchor_pages(self, seq: Sequence) -> int:
        """Full pages of seq's chain that end at or before its conversation anchor (0: none hinted)."""
        anchor = max((p for p, role in seq.request.checkpoint_hints if role == "anchor"), default=0)
        return min(anchor // self.pool.page_tokens, len(seq.chain))

    def hand_off_copies(self) -> None:
        """Give the copier what this step pinned (the engine calls it after the step)."""
        if self.host_out:
            assert self.copier is not None
            self.copier.submit(self.host_out)
            self.host_out = []

    def settle_copies(self, retry: bool = True) -> None:
        """Release the pins of records the copier has finished, then (`retry`) pin the deferred
        offers the pool has headroom for now (the engine calls it at step boundaries)."""
        if self.copier is None:
            return
        for job in self.copier.take_done():
            if job.state:
                assert self.states is not None
                self.states.unpin(job.index)
            else:
                self.pool.release([job.index])
            del self._copying[job.digest]
            self._copying_bytes -= self.host_state_bytes if job.state else self.host_page_bytes
        if retry:
            self._retry_deferred()

    @property
    def pinned_records(self) -> int:
        return len(self._copying)

    @property
    def copier_ns(self) -> int:
        return self.copier.worker_ns if self.copier is not None else 0

    @property
    def pinned_jobs(self) -> list[CopyJob]:
        return list(self._copying.values())

    @property
    def copies_pending(self) -> bool:
        """Pins are held (copies queued, in flight, or done and not yet released)."""
        return bool(self._copying)

    def reclaim(self) -> bool:
        """Pool pressure: wait for the copier to finish every pinned copy and release the pins;
        False when nothing was pinned."""
        if not self._copying or self.copier is None:
            return False
        started = time.perf_counter_ns()
        self.hand_off_copies()
        self.copier.wait()
        self.settle_copies(retry=False)
        assert self.host is not None
        self.host.stats.copy_waits += 1
        self.host.stats.copy_wait_ns += time.perf_counter_ns() - started
        return True
