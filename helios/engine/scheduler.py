"""Continuous batching with preemption: the only code that changes a sequence or its pages.

Invariants (each checked by tests/engine/test_scheduler.py without a model):
* A sequence is in exactly one of `waiting` (new, or preempted), `running`, or finished.
* Admission takes every page a sequence's tokens need (after prefix reuse) and reserves
  what each of its choices needs to commit one more token; forks and first growth draw on
  that reservation, so an admitted request always makes progress.
* A running sequence that cannot grow preempts the newest running sequences (their pages
  are released, their tokens, sampler and constraint state kept); preempted sequences go
  back to the front of the queue and are recomputed, reusing their published pages from
  the prefix cache where those survive. Only a sequence that alone fills the pool stops
  with the length cause; other requests' load never shortens an output.
* Every finish (stop, length, abort, error) releases the sequence's pages and reservation.
* Draft state (history indexes, a learned drafter's proposals and progress) is dropped at every
  finish and, for the learned drafter, at preemption (Drafter.finished / preempted); a learned
  drafter's KV lives on the sequence's own pages, so it goes with them.
* Hybrid cores (recurrent state, state_slots.py): every running sequence holds one live state
  slot, taken at admission or fork and released with its pages. Its prefix is reused only as
  far as a state snapshot reaches; prefill chunks end at snapshot boundaries so the state
  there can be captured: multiples of the snapshot interval, the prompt's last page boundary,
  and the request's checkpoint hints chosen at first admission under its work allowance
  (checkpoints.py). A drafting sequence borrows a spare slot for the step: the step's copy of its
  state before verification. A round with every draft accepted gives the spare back; a rejection
  makes the spare its live slot (the state before the step) and rewinds num_computed to the
  round's first position, so the next step recomputes the committed tokens without the rejected
  ones. Drafts stop short of the next page boundary, so a rewind never crosses a published page
  or a planned snapshot.
* Window-pool cores (window_pages.py): the sliding layers' pages are a second table per sequence,
  covered for each chunk when it is planned, trimmed after every step to what queries still to
  come can see, shared and copied at forks, released with the main pages; a prefix is reused only
  as far as the window pages its first query needs are still cached.
* Host store copy-out (copy_out.py): a finishing sequence's records the store lacks are pinned
  for the copier before its pages are released, or deferred when the pool lacks headroom. Pinned
  pages never fail an admission or force a preemption: under pool pressure the scheduler waits
  for the copier and releases every pin.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from helios.engine.checkpoints import StepCosts, select
from helios.engine.drafter import Drafter, SpeculationConfig
from helios.engine.kv_cache import ROOT_HASH, OutOfPages, PagePool, page_hash
from helios.engine.request import EngineEvent, EngineRequest, EngineStats, FinishCause
from helios.engine.copy_out import CopyOut
from helios.engine.host_copy import Copier
from helios.engine.host_store import HostStore, state_key
from helios.engine.state_slots import StatePool
from helios.engine.window_pages import WindowPages
from helios.engine.sequence import (
    Chunk,
    ModelOutput,
    SampledToken,
    SchedulerOutput,
    Sequence,
)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_concurrency: int  # live sequences (choices) at once
    prefill_chunk_size: int  # prefill tokens per step, summed over sequences
    max_model_len: int
    eos_ids: frozenset[int] = frozenset()
    # Hybrid cores: state snapshots are taken at prompt positions that are multiples of this
    # (a multiple of the page size), and at the prompt's last page boundary; 0: only there.
    snapshot_interval: int = 0
    # Hybrid cores: hinted snapshots (EngineRequest.checkpoint_hints) may add at most this fraction
    # of the request's predicted prefill time in predicted extra work; 0: none off the planned boundaries.
    checkpoint_work_fraction: float = 0.05
    # Cores whose image tokens attend each other both ways (attention_until): a prefill chunk never
    # ends inside an image, so all of its keys are written before any of its tokens attends.
    whole_images: bool = False


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: PagePool,
        stats: EngineStats | None = None,
        speculation: SpeculationConfig | None = None,
        states: StatePool | None = None,
        host: HostStore | None = None,
        host_page_bytes: int = 0,
        costs: StepCosts | None = None,
        copier: Copier | None = None,
        copy_queue_bytes: int = 256 << 20,
        window: WindowPages | None = None,
    ) -> None:
        self.config = config
        self.costs = costs if costs is not None else StepCosts()  # measured by the engine (hinted checkpoints)
        self.pool = pool
        self.states = states
        self.window = window  # the sliding layers' pages, reclaimed behind the window (window_pages.py)
        self._window_copies: list[tuple[int, int]] = []  # this plan's forked children's partial window pages
        self.host = host  # full pages of finished prefixes beyond the pool (host_store.py)
        self.host_page_bytes = host_page_bytes  # bytes of one page's record payload
        self._host_in: list[tuple[int, object]] = []  # this plan's page restores from the host store
        self._state_in: list[tuple[int, object]] = []  # this plan's state-slot restores from the host store
        # Finished prefixes pinned for the host store's copier, or deferred (copy_out.py).
        self.copy_out = CopyOut(pool, states, host, copier, host_page_bytes, copy_queue_bytes, self._next_step_pages)
        self.stats = (
            stats if stats is not None else EngineStats(total_pages=pool.num_pages, page_tokens=pool.page_tokens)
        )
        self.drafter = Drafter(speculation or SpeculationConfig(mode="off"), self.stats)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_prefetch = False  # the last plan left the queue's head waiting for its host-store prefetch
        self._arrivals = itertools.count()
        self._forked: list[Sequence] = []  # children created while planning; they join `running` after it
        self._planned_finishes: list[EngineEvent] = []  # finishes decided while planning this step
        self._state_before: list[tuple[int, int]] = []  # this plan's state copies (SchedulerOutput)
        self._state_after: list[tuple[int, int]] = []
        self._captures: list[tuple[Sequence, bytes, int, bool]] = []

    def _next_step_pages(self) -> int:
        """Pages the next step may need: one to grow each running sequence, and what the head of
        the queue needs to be admitted (copy-out pins never eat into them)."""
        need = sum(1 for seq in self.running if seq.finish is None)
        if self.waiting:
            head = self.waiting[0]
            need += self.pool.pages_for(len(head.token_ids)) + head.unforked
        return need

    # ------------------------------------------------------------------ requests
    def add(self, request: EngineRequest) -> None:
        seq = Sequence(
            request, 0, list(request.prompt_ids), len(request.prompt_ids), next(self._arrivals), unforked=request.n - 1
        )
        seq.reasoning_open = request.reasoning_budget is not None
        seq.constraint = request.constraint.fork() if request.constraint is not None else None
        self.waiting.append(seq)

    def min_pages(self, request: EngineRequest) -> int:
        """Pages the request needs to commit one token per choice in an otherwise empty pool."""
        return len(request.prompt_ids) // self.pool.page_tokens + request.n

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []
        budget = self.config.prefill_chunk_size
        preemptions_before = self.stats.preemptions
        index = 0
        spare = self._draft_rows()
        while index < len(self.running):  # oldest first; victims come off the tail, not yet planned
            seq = self.running[index]
            if seq.num_pending == 1 and not seq.scoring:
                if not self._grow(seq):
                    continue  # seq itself was preempted or finished: the list shifted
                drafts, states = self._drafts(seq, spare)
                spare -= len(drafts)
                chunks.append(self._chunk(seq, seq.num_computed, 1, copies, drafts, states))
                if self.states is not None and (seq.num_computed + 1) % self.pool.page_tokens == 0:
                    self._follow_endpoint(seq, seq.num_computed + 1)
            elif budget > 0 and seq.num_pending > 0:
                chunk = self._prefill_chunk(seq, budget, copies)
                if chunk is not None:  # None: the window pool has no page for it this step
                    chunks.append(chunk)
                    budget -= chunk.num_tokens
            index += 1
        preempted = self.stats.preemptions != preemptions_before
        self.awaiting_prefetch = False
        while self.waiting and budget > 0 and not preempted:  # no re-admission into a pool just found short
            head = self.waiting[0]
            if self.host is not None and self.host.prefetching(head.request.request_id):
                # Its disk records are being read off this thread: admitted once they are in memory
                # (running sequences keep stepping meanwhile).
                self.awaiting_prefetch = True
                break
            # Running parents count their unforked children: they take a slot when they fork.
            live = sum(s.num_choices for s in self.running) + len(self._forked)
            if live + head.num_choices > self.config.max_concurrency:
                break
            if not self._admit(head, budget):
                if not self.running and not self._forked:  # even an empty pool cannot hold it
                    self.waiting.popleft()
                    self._finish_alone(head)
                    continue
                break
            self.waiting.popleft()
            self.running.append(head)
            chunk = self._prefill_chunk(head, budget, copies)
            assert chunk is not None, "admission secured the first chunk's window pages"
            chunks.append(chunk)
            budget -= chunk.num_tokens
        self.running += self._forked
        self._forked = []
        finished, self._planned_finishes = tuple(self._planned_finishes), []
        before, after, captures = tuple(self._state_before), tuple(self._state_after), tuple(self._captures)
        self._state_before, self._state_after, self._captures = [], [], []
        host_in, self._host_in = tuple(self._host_in), []
        state_in, self._state_in = tuple(self._state_in), []
        window_copies, self._window_copies = tuple(self._window_copies), []
        return SchedulerOutput(
            tuple(chunks), tuple(copies), finished, before, after, captures, host_in, window_copies, state_in
        )

    def _prefill_chunk(self, seq: Sequence, budget: int, copies: list[tuple[int, int]]) -> Chunk | None:
        start = seq.num_computed
        end = self._whole_images(seq, start, start + min(seq.num_pending, budget))
        if self.window is not None:  # cut to the window pages the pool has left (never below one token)
            cut = self.window.coverable(seq, end)
            if cut < end:
                end = self._whole_images(seq, start, cut)
                if end > cut or end <= start:  # the pages left end inside an image it must finish: wait
                    return None
        size = end - start
        if self.states is not None and self.states.num_snapshots:
            boundary = self._next_boundary(seq)
            if boundary is not None and boundary < seq.num_computed + size:
                size = boundary - seq.num_computed  # end at the boundary, so its state can be captured
            if seq.num_computed + size == boundary:
                self._capture(seq, boundary)
        return self._chunk(seq, seq.num_computed, size, copies)

    def _whole_images(self, seq: Sequence, start: int, end: int) -> int:
        """A chunk's end moved off any image it would split (whole_images cores): back to the image's
        start, or, when the chunk starts inside or at the image, on to its end (past the budget)."""
        if not self.config.whole_images:
            return end
        for image in seq.request.images:
            for first, _, rows in image.spans():
                if first < end < first + rows:
                    end = first if first > start else first + rows
        return end

    # ------------------------------------------------------------------ recurrent state (hybrid cores)
    def _next_boundary(self, seq: Sequence) -> int | None:
        """The next prompt position after num_computed where seq's state is snapshotted: a multiple
        of the snapshot interval, a chosen checkpoint, or the prompt's last page boundary (what a
        later prompt sharing this one can reuse; at least one token is always computed, so not the
        prompt's end)."""
        last = self._last_boundary(seq)
        if last <= seq.num_computed:
            return None
        interval = self.config.snapshot_interval
        following = (seq.num_computed // interval + 1) * interval if interval else last
        hinted = min((b for b in seq.checkpoints if b > seq.num_computed), default=last)
        return min(following, hinted, last)

    def _planned_boundary(self, seq: Sequence, boundary: int) -> bool:
        """Whether seq is snapshotted at this page boundary without any hint (no extra chunk)."""
        interval = self.config.snapshot_interval
        return boundary == self._last_boundary(seq) or bool(interval and boundary % interval == 0)

    def _choose_checkpoints(self, seq: Sequence) -> None:
        """At first admission: which of the request's hints seq snapshots (checkpoints.py)."""
        assert self.states is not None
        if not self.states.num_snapshots or not seq.request.checkpoint_hints:
            return
        costs, config = self.costs, self.config
        uncached = seq.num_prompt - seq.num_computed
        prefill = costs.prefill_ns(uncached, config.prefill_chunk_size)
        chosen, skips = select(
            seq.request.checkpoint_hints,
            page_tokens=self.pool.page_tokens,
            computed=seq.num_computed,
            last=self._last_boundary(seq),
            planned=lambda b: self._planned_boundary(seq, b),
            exists=lambda b: self.states is not None and self.states.has(self._digest_at(seq, b)),
            capture_ns=costs.capture_ns(self.stats.state_slot_bytes),
            allowance_ns=prefill * config.checkpoint_work_fraction if prefill is not None else None,
        )
        seq.checkpoints = {c.boundary: c for c in chosen}
        for reason in skips:
            self.stats.count_checkpoint_skip(reason)

    def _last_boundary(self, seq: Sequence) -> int:
        """The prompt's last page boundary before its final token (the longest prefix reusable later)."""
        return (seq.num_prompt - 1) // self.pool.page_tokens * self.pool.page_tokens

    def _digest_at(self, seq: Sequence, boundary: int) -> bytes:
        """The page-hash chain of seq's tokens up to a page boundary (its published chain, extended)."""
        size = self.pool.page_tokens
        digest = seq.chain[-1] if seq.chain else ROOT_HASH
        for index in range(len(seq.chain), boundary // size):
            digest = page_hash(
                digest, seq.request.page_identity(index, size), tuple(seq.token_ids[index * size : (index + 1) * size])
            )
        return digest

    def _capture(self, seq: Sequence, boundary: int) -> None:
        """Plan a copy of seq's state after this step into a snapshot slot for `boundary`."""
        assert self.states is not None and seq.state_slot is not None
        digest = self._digest_at(seq, boundary)
        if self.states.has(digest):
            return
        chosen = seq.checkpoints.get(boundary)
        anchor = chosen is not None and chosen.role == "anchor"
        slot = self.states.claim(anchor)
        if slot is None:
            self.stats.count_checkpoint_skip("storage")
            return
        self._state_after.append((seq.state_slot, slot))
        self._captures.append((seq, digest, slot, anchor))
        if chosen is not None:
            self.stats.count_checkpoint_capture(chosen.role)
            self.stats.checkpoint_extra_work_ns += chosen.cost_ns
        elif boundary == self._last_boundary(seq):
            self.stats.count_checkpoint_capture("message")  # the last page boundary of the request's messages

    def _follow_endpoint(self, seq: Sequence, boundary: int) -> None:
        """Exact endpoint capture for a decoding hybrid sequence: after a step that ends on a page
        boundary, its state is copied into the sequence's own (unregistered) endpoint snapshot slot,
        so when it finishes, the next turn of its conversation resumes from its last full page
        instead of recomputing the answer. Registered at finish or preemption; a failed step's
        sequence returns the slot."""
        assert self.states is not None and seq.state_slot is not None
        if seq.endpoint_slot is None:
            seq.endpoint_slot = self.states.claim()
            if seq.endpoint_slot is None:
                self.stats.count_checkpoint_skip("storage")
                return
        self._state_after.append((seq.state_slot, seq.endpoint_slot))
        seq.endpoint_digest = self._digest_at(seq, boundary)

    def _settle_endpoint(self, seq: Sequence, keep: bool) -> None:
        """Register (keep) or return the sequence's endpoint snapshot slot."""
        slot, digest = seq.endpoint_slot, seq.endpoint_digest
        seq.endpoint_slot, seq.endpoint_digest = None, None
        if self.states is None or slot is None:
            return
        if keep and digest is not None and not self.states.has(digest):
            self.states.register(digest, slot)
            self.stats.count_checkpoint_capture("endpoint")
        else:
            self.states.unclaim(slot)

    def _reusable_prefix(self, seq: Sequence, pages: list[int], end: bytes) -> tuple[list[int], bytes, int | None]:
        """Of the cached pages matched for seq, those its recurrent state can resume after: up to the
        longest boundary with a snapshot (returned, to restore before the step); the rest released."""
        assert self.states is not None
        chain = self._chain_of(seq, len(pages), end)
        found = self.states.lookup(chain)
        keep = found[0] if found is not None else 0
        self.pool.release(pages[keep:])
        return pages[:keep], chain[keep - 1] if keep else ROOT_HASH, found[1] if found is not None else None

    def _window_prefix(self, seq: Sequence, pages: list[int], end: bytes) -> tuple[list[int], bytes]:
        """Of the cached pages matched for seq, those whose window pages are still cached too (its
        first query's window); the rest released."""
        assert self.window is not None
        chain = self._chain_of(seq, len(pages), end)
        keep = self.window.reusable(seq, chain, seq.token_ids)
        self.pool.release(pages[keep:])
        return pages[:keep], chain[keep - 1] if keep else ROOT_HASH

    def _chunk(
        self,
        seq: Sequence,
        start: int,
        size: int,
        copies: list[tuple[int, int]],
        drafts: tuple[int, ...] = (),
        states: tuple = (),
    ) -> Chunk:
        wants = start + size == len(seq.token_ids)
        if self.window is not None:
            covered = self.window.cover(seq, start + size + len(drafts))
            assert covered, "planning secured the chunk's window pages"
        choices: tuple[Sequence, ...] = (seq,)
        if wants and seq.unforked and seq.request.max_tokens > 0:
            choices += tuple(self._fork(seq, start + size, copies))
        return Chunk(
            seq,
            start,
            size,
            wants_logits=wants,
            scored=seq.scoring,
            choices=choices,
            draft_ids=drafts,
            draft_states=states,
        )

    # ------------------------------------------------------------------ speculation
    def _draft_rows(self) -> int:
        """Draft tokens this step may add: adaptive speculation stops where decode rows alone
        reach the row budget (the step is compute-bound there, and drafts would only cost), and
        wherever its gate measured drafts losing to plain steps at this many sequences."""
        drafter = self.drafter
        if not drafter.enabled:
            return 0
        if drafter.config.mode == "fixed":
            return 1 << 30
        decoding = sum(1 for s in self.running if s.num_pending == 1 and not s.scoring)
        if not drafter.gate.allow(decoding):
            return 0
        return max(0, drafter.config.row_budget - decoding)

    def _drafts(self, seq: Sequence, spare: int) -> tuple[tuple[int, ...], tuple]:
        """Drafts for a decode sequence whose next page is secured, within `spare` rows and its
        limits, and for a constrained one the constraint before each verification row (its own,
        then forks advanced through each draft; drafts the grammar rejects are cut). Pages for
        drafts come only from free ones: drafts never preempt."""
        if spare <= 0 or seq.unforked or not self._may_draft(seq):
            return (), ()
        limit = min(spare, self._room(seq), self._state_room(seq))
        drafts = self.drafter.propose(seq, self.drafter.depth(seq, limit)) if limit > 0 else ()
        states: list = []
        if seq.constraint is not None and drafts:
            states.append(seq.constraint)
            for token in drafts:
                state = states[-1].fork()
                if not state.advance(token):
                    break
                states.append(state)
            drafts = drafts[: len(states) - 1]
        size = self.pool.page_tokens
        while drafts and len(seq.pages) * size < len(seq.token_ids) + len(drafts):
            # A page per running sequence stays free for their own growth this step.
            if self.pool.num_available <= len(self.running):
                drafts = drafts[: len(seq.pages) * size - len(seq.token_ids)]
                break
            seq.pages.append(self.pool.allocate())
        if drafts and self.window is not None:  # drafts never preempt: only pages the window pool has left
            end = self.window.coverable(seq, len(seq.token_ids) + len(drafts))
            drafts = drafts[: max(0, end - len(seq.token_ids))]
        if drafts and self.states is not None:
            assert seq.state_slot is not None
            seq.rollback_slot = self.states.borrow()
            if seq.rollback_slot is None:
                return (), ()
            self._state_before.append((seq.state_slot, seq.rollback_slot))
        return drafts, tuple(states[: len(drafts) + 1]) if drafts else ()

    def _state_room(self, seq: Sequence) -> int:
        """Drafts a hybrid sequence may take: its round stays short of the next page boundary (so
        a rewind after a rejection never re-enters a published page or a planned snapshot), and
        only while a spare state slot is free for the rollback copy. Unlimited without state."""
        if self.states is None:
            return 1 << 30
        if not self.states.can_borrow:
            return 0
        size = self.pool.page_tokens
        boundary = (seq.num_computed // size + 1) * size
        return max(0, boundary - seq.num_computed - 2)

    def _room(self, seq: Sequence) -> int:
        """Drafts seq may take within its limits: the correction or bonus token always follows."""
        return min(seq.request.max_tokens - seq.num_output - 1, self.config.max_model_len - len(seq.token_ids) - 1)

    def learned_depths(self) -> dict[int, int]:
        """id(seq) -> drafts the learned drafter should propose after this step for each running
        sequence's next round, sharing the step's spare rows oldest first as planning will; 0 (left
        out) where it could not draft or where its history's proposal wins anyway (Drafter.propose)."""
        drafter = self.drafter
        if not drafter.enabled or not drafter.config.learned:
            return {}
        spare = self._draft_rows()
        depths: dict[int, int] = {}
        for seq in self.running:
            if spare <= 0:
                break
            if seq.num_pending != 1 or seq.scoring or seq.unforked or not self._may_draft(seq):
                continue
            k = drafter.depth(seq, min(spare, self._room(seq), self._state_room(seq)))
            if k > 0 and not drafter.history_wins(seq, k):
                depths[id(seq)] = k
                spare -= k
        return depths

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        """An open reasoning budget decodes one token at a time: its forced close depends on each
        committed token."""
        return not (seq.request.reasoning_budget is not None and seq.reasoning_open)

    def _grow(self, seq: Sequence) -> bool:
        """Pages for one more token of `seq`, preempting newer sequences; False when seq left running."""
        while len(seq.pages) * self.pool.page_tokens < len(seq.token_ids):
            if seq.reserved:
                seq.reserved -= 1
                seq.pages.append(self.pool.allocate(reserved=True))
                continue
            try:
                seq.pages.append(self.pool.allocate())
                continue
            except OutOfPages:
                pass
            if self.copy_out.reclaim():  # pages pinned for the copier come back first
                continue
            if not self._make_room(seq):
                return False
        while self.window is not None and not self.window.cover(seq, len(seq.token_ids)):
            if not self._make_room(seq):
                return False
        return True

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the newest running sequence for seq's growth; False when that was seq itself (or
        it could not fit even alone, and finished)."""
        victim = self.running[-1]
        if victim is seq and len(self.running) == 1 and not self._forked:
            self._finish_alone(seq)
            return False
        self._preempt(victim)
        return victim is not seq

    def _preempt(self, seq: Sequence) -> None:
        """Release seq's pages and reservation and queue it first; its tokens and state are kept."""
        self.running.remove(seq)
        self._settle_endpoint(seq, keep=True)  # its copies were made by steps that succeeded
        self.drafter.preempted(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.chain = []
        if seq.scoring:
            seq.prompt_entries, seq.prompt_chunk_ends = [], []  # scored prefill is replayed from the start
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _finish_alone(self, seq: Sequence) -> None:
        """A sequence that cannot fit even an otherwise empty pool (spec: past page capacity)."""
        self._planned_finishes += self._finish_all(seq, FinishCause.LENGTH)

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Take pages for seq's tokens (after prefix reuse) and reserve its choices' next pages."""
        tokens, size = seq.token_ids, self.pool.page_tokens
        pages: list[int] = []
        end = ROOT_HASH
        if seq.request.use_prefix_cache and not seq.scoring:
            # At least the last token is computed here: its logits are the next sample.
            identity = lambda index: seq.request.page_identity(index, size)  # noqa: E731
            pages, end = self.pool.match_prefix(tokens, identity, (len(tokens) - 1) // size)
        snapshot = None
        if pages and self.states is not None:
            pages, end, snapshot = self._reusable_prefix(seq, pages, end)
        if pages and self.window is not None:
            pages, end = self._window_prefix(seq, pages, end)
        needed = self.pool.pages_for(len(tokens)) - len(pages)
        growth = 1 if len(tokens) % size == 0 else 0  # the next token starts a new page
        reserve = growth + seq.unforked  # each unforked child needs one private page for its first token
        short = needed + reserve > self.pool.num_available
        if not short and self.window is not None:  # its first chunk's window pages, and its forks' copies
            start = len(pages) * size
            first_end = self._whole_images(seq, start, start + min(len(tokens) - start, budget))
            short = self.window.needed(seq, start, first_end) + seq.unforked > self.window.pool.num_available
            short = short or not self.window.reserve_forks(seq)
        if short:
            self.pool.release(pages)
            if self.window is not None:
                self.window.release(seq)
            # Pages pinned for the copier count as available later: wait for it, then try again.
            return self.copy_out.reclaim() and self._admit(seq, budget)
        if self.states is not None:  # within max_concurrency, so a live slot is free
            seq.state_slot = self.states.allocate()
        seq.pages = pages + [self.pool.allocate() for _ in range(needed)]
        self.pool.reserve(reserve)
        seq.reserved = reserve
        reused, state = len(pages), None
        if self.host is not None and seq.request.use_prefix_cache and not seq.scoring:
            restored, end, state = self._restore_from_host(seq, reused, end)
            reused += restored
        if state is not None:
            self._restore_state(seq, end, state)
        elif snapshot is not None:
            self._state_before.append((snapshot, seq.state_slot))
        seq.num_computed = reused * size
        seq.chain = self._chain_of(seq, reused, end)
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached = seq.num_computed
            reused_images = sum(1 for image in seq.request.images if image.end <= seq.num_computed)
            if reused_images:
                self.stats.images["input_reused_images_total"] += reused_images
            if self.states is not None:
                self._choose_checkpoints(seq)
        self.stats.reused_tokens += seq.num_computed
        return True

    def _restore_from_host(self, seq: Sequence, first: int, parent: bytes) -> tuple[int, bytes, object | None]:
        """Fill seq's pages after the pool's match from the host store's records of the same chain
        (copied in before the step, published now); a hybrid's only as far as a state record
        reaches. Returns (pages restored, chain hash after them, that state record's payload)."""
        assert self.host is not None
        size, tokens = self.pool.page_tokens, seq.token_ids
        found: list[
            tuple[bytes, bytes, bytes, tuple[int, ...], object]
        ] = []  # (digest, parent, identity, tokens, payload)
        start = parent
        for index in range(first, (len(tokens) - 1) // size):  # the last token is always computed
            chunk = tuple(tokens[index * size : (index + 1) * size])
            identity = seq.request.page_identity(index, size)
            digest = page_hash(parent, identity, chunk)
            record = self.host.fetch(digest, parent, chunk)
            if record is None or record.nbytes != self.host_page_bytes:
                break
            found.append((digest, parent, identity, chunk, record.payload))
            parent = digest
        state = None
        if self.states is not None:  # the longest restored boundary with a state record
            while found and state is None:
                record = self.host.fetch(state_key(found[-1][0]), found[-1][0], ())
                if record is not None and record.nbytes == self.copy_out.host_state_bytes:
                    state = record.payload
                else:
                    found.pop()
        for index, (_digest, previous, identity, chunk, payload) in enumerate(found, start=first):
            page = seq.pages[index]
            self._host_in.append((page, payload))
            self.pool.publish(page, previous, identity, chunk)
        restored = len(found)
        stats = self.host.stats
        stats.bytes_in += restored * self.host_page_bytes + (self.copy_out.host_state_bytes if state is not None else 0)
        if restored:
            stats.hits += 1
            stats.reused_tokens += restored * size
        stats.missing_tokens.observe(len(tokens) - (first + restored) * size)
        if restored and self.host.copy_ns_per_byte and self.host.prefill_ns_per_token:
            stats.transfer_ns.observe(restored * self.host_page_bytes * self.host.copy_ns_per_byte)
            stats.prefill_ns.observe(restored * size * self.host.prefill_ns_per_token)
        return restored, found[-1][0] if found else start, state

    def _restore_state(self, seq: Sequence, digest: bytes, payload: object) -> None:
        """A hybrid's recurrent state at the restored boundary, from its host record: written into
        seq's live slot before the step, and into a snapshot slot registered once the step ran (so
        the next request sharing the prefix resumes from the pool)."""
        assert self.states is not None and seq.state_slot is not None
        self._state_in.append((seq.state_slot, payload))
        slot = self.states.claim() if not self.states.has(digest) else None
        if slot is not None:
            self._state_in.append((slot, payload))
            self._captures.append((seq, digest, slot, False))

    def _chain_of(self, seq: Sequence, num_pages: int, end: bytes) -> list[bytes]:
        chain, parent, size, tokens = [], ROOT_HASH, self.pool.page_tokens, seq.token_ids
        for index in range(num_pages):
            parent = page_hash(
                parent, seq.request.page_identity(index, size), tuple(tokens[index * size : (index + 1) * size])
            )
            chain.append(parent)
        assert not chain or chain[-1] == end
        return chain

    def _fork(self, parent: Sequence, computed: int, copies: list[tuple[int, int]]) -> list[Sequence]:
        """Children 1..n-1 of a parent whose prompt finishes this step; they sample from its row.

        Full pages are shared; the partial last page is copied after the step writes it.
        Each child takes one page of the parent's reservation (its copy, or its first growth page).
        """
        size = self.pool.page_tokens
        full = computed // size
        children = []
        for index in range(1, parent.unforked + 1):
            child = Sequence(parent.request, index, list(parent.token_ids), parent.num_prompt, parent.arrival)
            for page in parent.pages[:full]:
                self.pool.share(page)
            child.pages = list(parent.pages[:full])
            if len(parent.pages) > full:
                page = self.pool.allocate(reserved=True)
                copies.append((parent.pages[full], page))
                child.pages.append(page)
            else:
                child.reserved = 1  # the reserved page passes to the child, for its first token
            if self.window is not None:
                self.window.fork(parent, child, full, self._window_copies)
            parent.reserved -= 1
            child.num_computed, child.num_cached, child.admitted = computed, parent.num_cached, True
            child.chain = list(parent.chain)
            child.prompt_entries, child.prompt_chunk_ends = parent.prompt_entries, parent.prompt_chunk_ends
            child.reasoning_open = parent.reasoning_open
            child.constraint = parent.request.constraint.fork() if parent.request.constraint is not None else None
            if self.states is not None:  # the parent's state after this step, copied
                assert parent.state_slot is not None
                child.state_slot = self.states.allocate()
                self._state_after.append((parent.state_slot, child.state_slot))
            children.append(child)
        parent.unforked = 0
        self._forked += children
        return children

    # ------------------------------------------------------------------ results
    def update_from_output(self, plan: SchedulerOutput, output: ModelOutput) -> list[EngineEvent]:
        """Commit a step: computed positions, published pages, sampled tokens, stops and finishes."""
        events: list[EngineEvent] = []
        drafts = {id(chunk.seq): len(chunk.draft_ids) for chunk in plan.chunks if chunk.draft_ids}
        for _, digest, slot, anchor in plan.captures:  # the step ran, so the copies after it were made
            assert self.states is not None
            self.states.register(digest, slot, anchor)
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.finish is not None:
                continue
            end = chunk.start + chunk.num_tokens
            if chunk.start < seq.num_prompt:
                self.stats.prefill_tokens += min(end, seq.num_prompt) - chunk.start
            seq.num_computed = end
            self.publish_full_pages(seq)
            entries = output.prompt_entries.get(id(chunk))
            if entries is not None:
                seq.prompt_entries.extend(entries)
                seq.prompt_chunk_ends.append(min(end, seq.num_prompt))
            if chunk.wants_logits and seq.request.max_tokens == 0:  # prompt scoring only: no output
                events += self._finish_all(seq, FinishCause.LENGTH)
        for seq in plan.sequences:
            if seq.finish is not None:
                continue
            error = output.errors.get(id(seq))
            if error is not None:
                events += self._finish_all(seq, FinishCause.ERROR, error)
                continue
            sampled = output.tokens.get(id(seq))
            if sampled is not None:
                events += self._commit(seq, sampled, drafts.get(id(seq), 0))
        if self.window is not None:
            for seq in self.running:
                self.window.trim(seq)
        return events

    def _commit(self, seq: Sequence, sampled: tuple[SampledToken, ...], offered: int) -> list[EngineEvent]:
        """Append a round's tokens: the accepted drafts, then the correction or bonus token; a
        stop among them ends the round there (what followed it was never generated)."""
        stats = self.stats
        if seq.num_output > 0:  # a decode round (the first token comes from prefill)
            stats.verification_rounds += 1
            stats.verification_drafts += offered
            stats.draft_rounds += offered > 0
            stats.count_round(offered)
        accepted = len(sampled) - 1  # every token before the last matched its draft
        round_start = seq.num_computed - 1  # the chunk's position (its one token, before the drafts)
        stats.accepted_drafts += accepted
        self.drafter.verified(seq, offered, accepted)
        tokens: list[int] = []
        entries: list = []
        cause, rejected = None, False
        for item in sampled:
            token = item.token_id
            seq.token_ids.append(token)
            tokens.append(token)
            entries.append(item.logprobs)
            stats.generated_tokens += 1
            self._track_reasoning(seq, item)
            rejected = seq.constraint is not None and not seq.constraint.advance(token)  # forced tokens too
            cause = self._stop_cause(seq, token)
            if cause is not None or rejected:
                break
        events = [self._event(seq, tuple(tokens), tuple(entries), cause)]
        if cause is not None:
            self._finish(seq, cause)
        elif rejected:
            events += self._finish_all(seq, FinishCause.ERROR, constraint_error(seq))
        else:
            seq.num_computed += accepted  # the accepted drafts' KV was written by this step
            self.publish_full_pages(seq)
            self.drafter.accepted(seq, offered, accepted)
            self._settle_rollback(seq, rewind_to=round_start if accepted < offered else None)
        return events

    def _settle_rollback(self, seq: Sequence, rewind_to: int | None) -> None:
        """End a hybrid sequence's round: give the borrowed slot back, or, when a draft was rejected
        (the live state absorbed it), make it the live slot and rewind to the round's first position."""
        if seq.rollback_slot is None:
            return
        assert self.states is not None and seq.state_slot is not None
        slot, seq.rollback_slot = seq.rollback_slot, None
        if rewind_to is not None:
            slot, seq.state_slot = seq.state_slot, slot
            seq.num_computed = rewind_to
            self.stats.state_rewinds += 1
        self.states.give_back(slot)

    def _track_reasoning(self, seq: Sequence, sampled: SampledToken) -> None:
        budget = seq.request.reasoning_budget
        if sampled.forced:
            seq.reasoning_open = False
            self.stats.reasoning_budget_cuts += 1
        elif budget is not None:
            if sampled.token_id == budget.close_id or sampled.token_id in budget.implicit_close_ids:
                seq.reasoning_open = False
            elif seq.reasoning_open:
                seq.reasoning_tokens += 1

    def _stop_cause(self, seq: Sequence, token: int) -> FinishCause | None:
        request = seq.request
        if token in self.config.eos_ids and not request.ignore_eos:
            return FinishCause.EOS
        if token in request.stop_token_ids:
            seq.stop_match_len = 1
            return FinishCause.STOP_TOKEN
        output = seq.output_ids
        for stop in request.stop_token_sequences:
            if len(output) >= len(stop) and tuple(output[-len(stop) :]) == stop:
                seq.stop_match_len = len(stop)
                return FinishCause.STOP_TOKEN
        if seq.num_output >= request.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return FinishCause.LENGTH
        return None

    def publish_full_pages(self, seq: Sequence) -> None:
        """Register every newly computed full page of `seq` in the prefix cache."""
        size = self.pool.page_tokens
        while (len(seq.chain) + 1) * size <= seq.num_computed:
            index = len(seq.chain)
            parent = seq.chain[-1] if seq.chain else ROOT_HASH
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            identity = seq.request.page_identity(index, size)
            seq.chain.append(self.pool.publish(seq.pages[index], parent, identity, tokens))
            if self.window is not None:
                self.window.publish(seq, index, parent, identity, tokens)

    # ------------------------------------------------------------------ finishing
    def fail(self, plan: SchedulerOutput, error: str) -> list[EngineEvent]:
        """A step that could not run: every sequence in it fails; the others are untouched."""
        events: list[EngineEvent] = []
        for seq in plan.sequences:
            if seq.finish is None:
                events += self._finish_all(seq, FinishCause.ERROR, error)
        for _, _, slot, _ in plan.captures:
            assert self.states is not None
            self.states.unclaim(slot)
        return events

    def abort(self, doomed: set[tuple[str, int | None]]) -> list[EngineEvent]:
        """Cancel whole requests ((id, None)) or single choices ((id, index))."""

        def hit(seq: Sequence) -> bool:
            rid = seq.request.request_id
            return (rid, None) in doomed or (rid, seq.choice_index) in doomed

        events: list[EngineEvent] = []
        for seq in [s for s in itertools.chain(self.running, self.waiting) if hit(s)]:
            events += self._finish_all(seq, FinishCause.ABORT)
        return events

    def _finish_all(self, seq: Sequence, cause: FinishCause, error: str | None = None) -> list[EngineEvent]:
        """Finish seq and the children it has not forked yet (they share its fate)."""
        events = [self._event(seq, (), (), cause, error)]
        events += [
            EngineEvent(
                seq.request.request_id,
                index,
                (),
                () if seq.request.num_top_logprobs is not None else None,
                cause,
                seq.num_prompt,
                seq.num_cached,
                0,
                None,
                error,
            )
            for index in range(seq.choice_index + 1, seq.choice_index + 1 + seq.unforked)
        ]
        self._count(cause, seq.num_choices)
        self._finish(seq, cause, count=False)
        return events

    def _finish(self, seq: Sequence, cause: FinishCause, count: bool = True) -> None:
        if count:
            self._count(cause, 1)
        seq.finish = cause
        seq.unforked = 0
        self.drafter.finished(seq)
        # A failed step may not have made the endpoint copy it planned: only other finishes keep it.
        self._settle_endpoint(seq, keep=cause is not FinishCause.ERROR)
        if cause is not FinishCause.ERROR:
            self.copy_out.offer(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _count(self, cause: FinishCause, choices: int) -> None:
        if cause is FinishCause.ERROR:
            self.stats.failed += choices
        elif cause is not FinishCause.ABORT:
            self.stats.completed += choices

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        self.pool.unreserve(seq.reserved)
        seq.pages, seq.reserved = [], 0
        if self.window is not None:
            self.window.release(seq)
        if self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
            if seq.rollback_slot is not None:
                self.states.give_back(seq.rollback_slot)
                seq.rollback_slot = None

    def _event(
        self,
        seq: Sequence,
        tokens: tuple[int, ...],
        entries: tuple,
        cause: FinishCause | None,
        error: str | None = None,
    ) -> EngineEvent:
        first = not seq.sent_first
        seq.sent_first = True
        request = seq.request
        return EngineEvent(
            request_id=request.request_id,
            choice_index=seq.choice_index,
            token_ids=tokens,
            logprobs=entries if request.num_top_logprobs is not None else None,
            finish=cause,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            stop_match_len=seq.stop_match_len,
            prompt_logprobs=tuple(seq.prompt_entries) if first and request.prompt_logprobs is not None else None,
            prompt_chunk_ends=tuple(seq.prompt_chunk_ends) if first and request.prompt_logprobs is not None else None,
            error=error,
        )

    def check_invariants(self) -> None:
        """Pages and reservations add up (tests; cheap enough to call after every step there)."""
        refs = [0] * self.pool.num_pages
        for seq in self.running:
            for page in seq.pages:
                refs[page] += 1
        for job in self.copy_out.pinned_jobs:
            if not job.state:
                refs[job.index] += 1
        assert refs == self.pool.ref_count, "page references do not match the running sequences"
        assert self.pool.num_reserved == sum(s.reserved for s in self.running), "reservations leaked"
        assert all(not s.pages and not s.reserved for s in self.waiting), "a waiting sequence holds pages"
        assert self.pool.num_free + self.pool.num_cached + self.pool.num_private == self.pool.num_pages
        if self.window is not None:
            assert self.window.refs(self.running) == self.window.pool.ref_count, "window page references leaked"
            assert self.window.pool.num_reserved == sum(s.window_reserved for s in self.running), "window reservations"
            assert all(not s.window_pages for s in self.waiting), "a waiting sequence holds window pages"
        if self.states is not None:
            assert all(s.state_slot is not None for s in self.running), "a running sequence has no state slot"
            assert all(s.state_slot is None for s in self.waiting), "a waiting sequence holds a state slot"
            lent = sum(s.rollback_slot is not None for s in self.running)
            assert lent == self.states.num_borrowed, "a borrowed state slot is not held by a running sequence"
            self.states.check(len(self.running))


def constraint_error(seq: Sequence) -> str:
    reason = seq.constraint.error if seq.constraint is not None else None
    return f"output constraint failed: {reason or 'no token is allowed'}"
