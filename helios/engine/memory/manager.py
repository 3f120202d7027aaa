"""The memory manager: every page, window page and state slot a sequence holds, drawn and given
back through one interface, as vLLM v1's scheduler draws on its KVCacheManager.

The scheduler owns a sequence's progress (tokens, num_computed, finishes); the manager owns its
memory fields (pages, reserved, chain, window_pages, window_reserved, state_slot, endpoint_slot,
rollback_slot, checkpoints) and writes nothing else. Its interface:

  match(seq)          the cached prefix seq can resume from (pool pages, window pages, snapshot)
  admit(seq, ...)     take that prefix, seq's remaining pages, its reservation and state slot,
                      and whatever the host store restores (at first admission, choose its
                      checkpoints and count its device hits); returns the tokens reused
  grow(seq)           pages for seq's next token (its reservation first); False: preempt someone
  fork(parent, child) a child's share of its parent's pages, its copies and its state slot
  commit(seq)         publish seq's newly computed full pages in the prefix caches
  release(seq, how)   give everything back (finish: copy-out to the host store first)

around a step: chunk planning (coverable, cut_prefill, decoding, draft pages), take_plan (the
step's copies as one MemoryPlan), step_ran / step_failed, trim_windows; and check (tests).
Each hand-fed unit is tested in tests/engine/test_memory.py.

Invariants:
* Admission takes every page a sequence's tokens need (after prefix reuse) and reserves one page
  for each of its choices' next token; forks and first growth draw on that reservation.
* Prefix reuse is exact and only as far as every system can resume: the pool's pages, the
  window pages the first query needs (window_pages.py) and a state snapshot (snapshots.py).
* Pages pinned for the host store's copier (copy_out.py) never fail an admission or force a
  preemption: under pool pressure the manager waits for the copier and releases every pin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from helios.engine.memory import host_restore
from helios.engine.memory.chains import chain_of, page_tokens_of
from helios.engine.memory.checkpoints import StepCosts
from helios.engine.memory.copy_out import CopyOut
from helios.engine.memory.host_copy import Copier
from helios.engine.memory.host_store import HostStore
from helios.engine.memory.kv_cache import ROOT_HASH, OutOfPages, PagePool
from helios.engine.memory.plan import MemoryPlan, PlanBuilder
from helios.engine.memory.snapshots import Snapshots
from helios.engine.memory.state_slots import StatePool
from helios.engine.memory.window_pages import WindowPages
from helios.engine.request import EngineRequest, EngineStats
from helios.engine.sequence import Sequence

UNLIMITED = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    prefill_chunk_size: int  # prefill tokens per step (what a hinted checkpoint's allowance is predicted from)
    # Hybrid cores: snapshots at prompt positions that are multiples of this (a multiple of the page
    # size) and at the prompt's last page boundary; 0: only there.
    snapshot_interval: int = 0
    checkpoint_work_fraction: float = 0.05  # hinted snapshots' extra work, as a fraction of predicted prefill
    host_page_bytes: int = 0  # bytes of one page's host record payload
    copy_queue_bytes: int = 256 << 20  # bound on pinned bytes the copier has not released yet


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix a sequence can resume from."""

    pages: tuple[int, ...]  # pool pages of its first full pages, shared (ref-counted) until admitted or released
    end: bytes  # the chain hash after them (ROOT_HASH: none)
    snapshot: int | None  # hybrid cores: the snapshot slot holding the state at their end


class Release(Enum):
    FINISH = "finish"  # registers the endpoint snapshot, offers the prefix to the host store
    PREEMPT = "preempt"  # registers the endpoint snapshot; the sequence is recomputed from its prefix
    ERROR = "error"  # a failed step may not have made the copies it planned: nothing is registered


class MemoryManager:
    def __init__(
        self,
        config: MemoryConfig,
        pool: PagePool,
        stats: EngineStats,
        next_step_pages: Callable[[], int],
        states: StatePool | None = None,
        window: WindowPages | None = None,
        host: HostStore | None = None,
        copier: Copier | None = None,
        costs: StepCosts | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.page_tokens = pool.page_tokens
        self.stats = stats
        self.states = states
        self.window = window  # the sliding layers' pages, reclaimed behind the window (window_pages.py)
        self.host = host  # full pages of finished prefixes beyond the pool (host_store.py)
        self._plan = PlanBuilder()
        self.snapshots = (
            Snapshots(
                states,
                pool.page_tokens,
                stats,
                costs if costs is not None else StepCosts(),
                config.snapshot_interval,
                config.checkpoint_work_fraction,
                config.prefill_chunk_size,
                self._plan,
            )
            if states is not None
            else None
        )
        # Finished prefixes pinned for the host store's copier, or deferred; next_step_pages is the
        # scheduler's count of pages its next step may need (pins never eat into them).
        self.copy_out = CopyOut(
            pool, states, host, copier, config.host_page_bytes, config.copy_queue_bytes, next_step_pages
        )

    # ------------------------------------------------------------------ accounting
    def pages_for(self, num_tokens: int) -> int:
        return self.pool.pages_for(num_tokens)

    def min_pages(self, request: EngineRequest) -> int:
        """Pages the request needs to commit one token per choice in an otherwise empty pool."""
        return len(request.prompt_ids) // self.page_tokens + request.n

    # ------------------------------------------------------------------ admission
    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix seq can resume from: full pool pages (never the last token's:
        its logits are the next sample), cut to the longest snapshot (hybrid cores) and to what the
        first query's window pages allow (window-pool cores; those pages are taken into seq's table)."""
        size = self.page_tokens
        if not seq.request.use_prefix_cache or seq.scoring:
            return PrefixMatch((), ROOT_HASH, None)
        identity = lambda index: seq.request.page_identity(index, size)  # noqa: E731
        pages, end = self.pool.match_prefix(seq.token_ids, identity, (len(seq.token_ids) - 1) // size)
        snapshot = None
        if pages and self.snapshots is not None:
            keep, snapshot = self.snapshots.reusable(seq, len(pages))
            pages, end = self._keep(seq, pages, keep)
        if pages and self.window is not None:
            keep = self.window.reusable(seq, chain_of(seq, len(pages), size), seq.token_ids)
            pages, end = self._keep(seq, pages, keep)
        return PrefixMatch(tuple(pages), end, snapshot)

    def _keep(self, seq: Sequence, pages: list[int], keep: int) -> tuple[list[int], bytes]:
        self.pool.release(pages[keep:])
        return pages[:keep], chain_of(seq, keep, self.page_tokens)[-1] if keep else ROOT_HASH

    def admit(self, seq: Sequence, first_chunk_end: Callable[[int], int]) -> int | None:
        """Take seq's pages (after prefix reuse, the pool's then the host store's), reserve its
        choices' next pages and its forks' window copies, and give it a live state slot. Returns the
        tokens reused (seq.num_computed to be), or None, holding nothing, when the pools are short.
        first_chunk_end(start): where its first prefill chunk would end (its window pages are secured)."""
        size, tokens = self.page_tokens, seq.token_ids
        match = self.match(seq)
        pages = list(match.pages)
        needed = self.pool.pages_for(len(tokens)) - len(pages)
        growth = 1 if len(tokens) % size == 0 else 0  # the next token starts a new page
        reserve = growth + seq.unforked  # each unforked child needs one private page for its first token
        short = needed + reserve > self.pool.num_available
        if not short and self.window is not None:  # its first chunk's window pages, and its forks' copies
            start = len(pages) * size
            first_end = first_chunk_end(start)
            short = self.window.needed(seq, start, first_end) + seq.unforked > self.window.pool.num_available
            short = short or not self.window.reserve_forks(seq)
        if short:
            self.pool.release(pages)
            if self.window is not None:
                self.window.release(seq)
            # Pages pinned for the copier count as available later: wait for it, then try again.
            return self.admit(seq, first_chunk_end) if self.copy_out.reclaim() else None
        if self.snapshots is not None:
            self.snapshots.allocate(seq)
        seq.pages = pages + [self.pool.allocate() for _ in range(needed)]
        self.pool.reserve(reserve)
        seq.reserved = reserve
        reused, end, state = len(pages), match.end, None
        if not seq.admitted:  # api.md reused_tokens: device prefix-cache hits, once per request admission
            self.stats.reused_tokens += reused * size  # (the host store counts its own restores)
        if self.host is not None and seq.request.use_prefix_cache and not seq.scoring:
            hybrid = self.copy_out.host_state_bytes if self.states is not None else None
            restored = host_restore.restore(
                self.host, self.pool, seq, reused, end, self.config.host_page_bytes, hybrid, self._plan
            )
            reused, end, state = reused + restored.pages, restored.end, restored.state
        if self.snapshots is not None:
            self.snapshots.resume(seq, match.snapshot, end, state)
        seq.chain = chain_of(seq, reused, size)
        assert not seq.chain or seq.chain[-1] == end
        if self.snapshots is not None and not seq.admitted:  # which hinted boundaries it snapshots
            self.snapshots.choose(seq, reused * size)
        return reused * size

    # ------------------------------------------------------------------ growth and forks
    def grow(self, seq: Sequence) -> bool:
        """Pages (and window pages) for seq's tokens: its reservation first, then free or evictable
        pages, then pages pinned for the copier. False when the pools are short: the scheduler
        preempts and asks again (what was taken stays taken)."""
        while len(seq.pages) * self.page_tokens < len(seq.token_ids):
            if seq.reserved:
                seq.reserved -= 1
                seq.pages.append(self.pool.allocate(reserved=True))
                continue
            try:
                seq.pages.append(self.pool.allocate())
                continue
            except OutOfPages:
                pass
            if not self.copy_out.reclaim():  # pages pinned for the copier come back first
                return False
        return self.window is None or self.window.cover(seq, len(seq.token_ids))

    def fork(self, parent: Sequence, child: Sequence, computed: int) -> None:
        """A child of a parent whose prompt ends this step at `computed`: it shares the parent's full
        pages and gets a copy of the partial one after the step, drawn from the parent's reservation
        (or that reserved page passes to it, for its first token); the same for its window pages;
        on hybrid cores a live slot holding the parent's state after the step."""
        full = computed // self.page_tokens
        for page in parent.pages[:full]:
            self.pool.share(page)
        child.pages = list(parent.pages[:full])
        if len(parent.pages) > full:
            page = self.pool.allocate(reserved=True)
            self._plan.page_copies.append((parent.pages[full], page))
            child.pages.append(page)
        else:
            child.reserved = 1
        if self.window is not None:
            self.window.fork(parent, child, full, self._plan.window_copies)
        parent.reserved -= 1
        child.chain = list(parent.chain)
        if self.snapshots is not None:
            self.snapshots.fork(parent, child)

    # ------------------------------------------------------------------ publication and release
    def commit(self, seq: Sequence) -> None:
        """Publish every newly computed full page of seq (num_computed advanced) in the prefix cache,
        and its window pages under the same chain hashes."""
        size = self.page_tokens
        while (len(seq.chain) + 1) * size <= seq.num_computed:
            index = len(seq.chain)
            parent = seq.chain[-1] if seq.chain else ROOT_HASH
            tokens = page_tokens_of(seq, index, size)
            identity = seq.request.page_identity(index, size)
            seq.chain.append(self.pool.publish(seq.pages[index], parent, identity, tokens))
            if self.window is not None:
                self.window.publish(seq, index, parent, identity, tokens)

    def release(self, seq: Sequence, how: Release) -> None:
        """Give back everything seq holds: pages, reservations, window pages, state slots. A finish
        first offers its published prefix to the host store (pinned before its pages go)."""
        if self.snapshots is not None:
            self.snapshots.settle_endpoint(seq, keep=how is not Release.ERROR)
        if how is Release.FINISH:
            self.copy_out.offer(seq)
        self.pool.release(seq.pages)
        self.pool.unreserve(seq.reserved)
        seq.pages, seq.reserved = [], 0
        if self.window is not None:
            self.window.release(seq)
        if self.snapshots is not None:
            self.snapshots.release(seq)
        if how is Release.PREEMPT:
            seq.chain = []

    # ------------------------------------------------------------------ planning a step
    def coverable(self, seq: Sequence, end: int) -> int:
        """The furthest end <= `end` of seq's next chunk whose window pages the pool has left."""
        return self.window.coverable(seq, end) if self.window is not None else end

    def cut_prefill(self, seq: Sequence, end: int) -> int:
        """A prefill chunk's end moved back to seq's next snapshot boundary; one ending there plans
        the capture of its state (hybrid cores)."""
        return self.snapshots.cut(seq, end) if self.snapshots is not None else end

    def decoding(self, seq: Sequence) -> None:
        """seq decodes one token this step: a hybrid's endpoint follows a page boundary it reaches."""
        if self.snapshots is not None:
            self.snapshots.follow_endpoint(seq)

    def cover(self, seq: Sequence, end: int) -> None:
        """Window pages for every position seq's chunk writes, up to `end` (planning secured them)."""
        if self.window is not None:
            covered = self.window.cover(seq, end)
            assert covered, "planning secured the chunk's window pages"

    def draft_room(self, seq: Sequence) -> int:
        """Drafts a hybrid may take this round (snapshots.draft_room); unlimited on other cores."""
        return self.snapshots.draft_room(seq) if self.snapshots is not None else UNLIMITED

    def draft_pages(self, seq: Sequence, count: int, keep_free: int) -> int:
        """Pages for up to `count` drafts after seq's tokens, from free pages only (drafts never
        preempt, and `keep_free` pages stay for the running sequences' growth), and on hybrid cores
        a rollback slot. Returns how many drafts have what they need."""
        size, tokens = self.page_tokens, len(seq.token_ids)
        while count and len(seq.pages) * size < tokens + count:
            if self.pool.num_available <= keep_free:
                count = min(count, len(seq.pages) * size - tokens)
                break
            seq.pages.append(self.pool.allocate())
        if count and self.window is not None:
            count = min(count, max(0, self.window.coverable(seq, tokens + count) - tokens))
        if count and self.snapshots is not None and not self.snapshots.borrow(seq):
            return 0
        return count

    def take_plan(self) -> MemoryPlan:
        """The copies planned since the last call, as one value for the executor."""
        return self._plan.build()

    # ------------------------------------------------------------------ after a step
    def step_ran(self, plan: MemoryPlan) -> None:
        """The step ran, so its copies were made: register its captures."""
        if self.snapshots is not None:
            self.snapshots.step_ran(plan)

    def step_failed(self, plan: MemoryPlan) -> None:
        """The step did not run: its captures' slots go back."""
        if self.snapshots is not None:
            self.snapshots.step_failed(plan)

    def settle_round(self, seq: Sequence, rejected: bool) -> bool:
        """End a drafting hybrid's round (its rollback slot); True when seq must rewind to the
        round's first position (a rejected draft: the rollback slot is its live slot now)."""
        return self.snapshots.settle_round(seq, rejected) if self.snapshots is not None else False

    def trim_windows(self, running: list[Sequence]) -> None:
        """Release the window pages no query still to come can see."""
        if self.window is not None:
            for seq in running:
                self.window.trim(seq)

    def check(self, running: list[Sequence], waiting: list[Sequence]) -> None:
        """Pages, reservations and slots add up (tests; cheap enough to call after every step there)."""
        pool = self.pool
        refs = [0] * pool.num_pages
        for seq in running:
            for page in seq.pages:
                refs[page] += 1
        for job in self.copy_out.pinned_jobs:
            if not job.state:
                refs[job.index] += 1
        assert refs == pool.ref_count, "page references do not match the running sequences"
        assert pool.num_reserved == sum(s.reserved for s in running), "reservations leaked"
        assert all(not s.pages and not s.reserved for s in waiting), "a waiting sequence holds pages"
        assert pool.num_free + pool.num_cached + pool.num_private == pool.num_pages
        if self.window is not None:
            assert self.window.refs(running) == self.window.pool.ref_count, "window page references leaked"
            assert self.window.pool.num_reserved == sum(s.window_reserved for s in running), "window reservations"
            assert all(not s.window_pages for s in waiting), "a waiting sequence holds window pages"
        if self.snapshots is not None:
            self.snapshots.check(running, waiting)
