"""The memory manager fed by hand (no model, no scheduler): prefix match, publication and
eviction; admission, growth and release accounting; fork reference counts; window trimming;
state snapshot planning; draft pages and rollback slots; host-store restores and copy-out."""

from __future__ import annotations

import torch

from helios.engine.memory.chains import chain_of
from helios.engine.memory.host_copy import Copier
from helios.engine.memory.host_store import HostStore, Record
from helios.engine.memory.kv_cache import ROOT_HASH, PagePool, page_hash
from helios.engine.memory.manager import MemoryConfig, MemoryManager, Release
from helios.engine.memory.plan import MemoryPlan
from helios.engine.memory.state_slots import StatePool
from helios.engine.memory.window_pages import NONE, WindowPages
from helios.engine.request import EngineRequest, EngineStats
from helios.engine.sequence import Sequence
from tests.engine.test_scheduler import PAGE, PARAMS

PAGE_BYTES = 8  # a host record's payload in these tests


def _seq(tokens: list[int] | range, n: int = 1, name: str = "r", arrival: int = 0) -> Sequence:
    request = EngineRequest(name, tuple(tokens), (PARAMS,) * n, max_tokens=8)
    return Sequence(request, 0, list(tokens), len(tokens), arrival, unforked=n - 1)


def _manager(
    pages: int = 16,
    states: StatePool | None = None,
    window: WindowPages | None = None,
    host: HostStore | None = None,
    copier: Copier | None = None,
    interval: int = 0,
) -> MemoryManager:
    pool = PagePool(pages, PAGE)
    stats = EngineStats(total_pages=pages, page_tokens=PAGE)
    config = MemoryConfig(64, interval, host_page_bytes=PAGE_BYTES, copy_queue_bytes=1 << 20)
    return MemoryManager(config, pool, stats, lambda: 0, states, window, host, copier)


def _admit(m: MemoryManager, seq: Sequence) -> int:
    """Admit seq as the scheduler does (its first chunk: the whole prompt), setting num_computed."""
    reused = m.admit(seq, lambda start: len(seq.token_ids))
    assert reused is not None
    seq.num_computed = reused
    return reused


def _computed(m: MemoryManager, seq: Sequence, end: int | None = None) -> None:
    """A step computed seq's positions up to `end` (all of them by default)."""
    seq.num_computed = len(seq.token_ids) if end is None else end
    m.commit(seq)


def _idle(m: MemoryManager) -> None:
    m.check([], [])
    assert sum(m.pool.ref_count) == 0 and m.pool.num_reserved == 0


# ---------------------------------------------------------------------------- prefix cache
def test_committed_pages_are_matched_by_a_later_prompt_up_to_the_first_difference() -> None:
    m = _manager()
    a = _seq(range(1, 11))  # two full pages and a partial one
    assert _admit(m, a) == 0 and len(a.pages) == 3
    _computed(m, a)
    assert len(a.chain) == 2 and m.pool.num_cached == 2  # the partial page is never published
    published = tuple(a.pages[:2])
    m.release(a, Release.FINISH)
    b = _seq([*range(1, 9), 50, 51, 52])
    match = m.match(b)
    assert match.pages == published
    assert match.end == chain_of(b, 2, PAGE)[-1] and match.snapshot is None
    assert all(m.pool.ref_count[page] == 1 for page in match.pages)  # shared until admitted or released
    m.pool.release(list(match.pages))
    assert _admit(m, b) == 8 and b.chain == chain_of(b, 2, PAGE)
    m.check([b], [])
    m.release(b, Release.FINISH)
    _idle(m)


def test_the_last_token_is_always_computed_and_scoring_or_opted_out_requests_match_nothing() -> None:
    m = _manager()
    a = _seq(range(1, 9))  # exactly two pages
    _admit(m, a)
    _computed(m, a)
    m.release(a, Release.FINISH)
    match = m.match(_seq(range(1, 9)))
    assert len(match.pages) == 1  # the second page holds the last token: its logits are sampled
    m.pool.release(list(match.pages))
    request = EngineRequest("s", tuple(range(1, 12)), (PARAMS,), max_tokens=1, use_prefix_cache=False)
    assert m.match(Sequence(request, 0, list(range(1, 12)), 11, 0)).pages == ()
    _idle(m)


def test_unreferenced_cached_pages_are_evicted_least_recently_used_first() -> None:
    m = _manager(pages=4)
    a = _seq(range(1, 10))  # 3 pages, 2 published
    _admit(m, a)
    _computed(m, a)
    m.release(a, Release.FINISH)
    assert m.pool.num_cached == 2 and m.pool.num_available == 4
    b = _seq(range(100, 113), name="b")  # 4 pages: takes the free pages, then evicts both cached ones
    assert _admit(m, b) == 0
    assert m.match(_seq(range(1, 10))).pages == ()  # a's prefix is gone
    m.release(b, Release.FINISH)
    _idle(m)


# ---------------------------------------------------------------------------- accounting
def test_admission_reserves_each_choices_next_page_and_holds_nothing_when_short() -> None:
    m = _manager(pages=5)
    big = _seq(range(1, 13))  # 3 pages; its first output token starts a 4th: reserved
    assert _admit(m, big) == 0 and len(big.pages) == 3 and big.reserved == 1 and m.pool.num_reserved == 1
    short = _seq(range(1, 7), n=2, name="n2")  # 2 pages + 1 reserved for its child: 3 > 1 left
    assert m.admit(short, lambda start: 6) is None
    assert short.pages == [] and short.reserved == 0 and m.pool.num_reserved == 1
    m.check([big], [short])
    assert m.min_pages(short.request) == 1 + 2
    m.release(big, Release.FINISH)
    _idle(m)


def test_growth_draws_on_the_reservation_first_and_reports_a_full_pool() -> None:
    m = _manager(pages=4)
    a, b = _seq(range(1, 9), name="a"), _seq(range(100, 103), name="b", arrival=1)
    _admit(m, a)  # 2 pages, 1 reserved
    a.token_ids.append(9)
    assert m.grow(a) and a.reserved == 0 and len(a.pages) == 3 and m.pool.num_reserved == 0  # the reserved page
    _admit(m, b)  # the pool's last page
    b.token_ids += [103, 104]  # 5 tokens: a second page that no one has
    assert not m.grow(b)
    m.release(a, Release.PREEMPT)  # the scheduler preempts, and asks again
    assert a.pages == [] and a.chain == []
    assert m.grow(b) and len(b.pages) == 2
    m.check([b], [a])
    m.release(b, Release.FINISH)
    _idle(m)


def test_forked_children_share_full_pages_and_copy_the_partial_one_from_the_reservation() -> None:
    m = _manager()
    parent = _seq(range(1, 7), n=3)  # 1 full page, 1 partial; two children reserved
    _admit(m, parent)
    assert parent.reserved == 2 and m.pool.num_reserved == 2
    full, partial = parent.pages
    children = [Sequence(parent.request, i, list(parent.token_ids), 6, 0) for i in (1, 2)]
    for child in children:
        m.fork(parent, child, 6)
    plan = m.take_plan()
    assert m.pool.ref_count[full] == 3 and parent.reserved == 0 and m.pool.num_reserved == 0
    assert plan.page_copies == tuple((partial, c.pages[1]) for c in children)
    assert m.take_plan() == MemoryPlan()  # handed over once
    m.check([parent, *children], [])
    for seq in (parent, *children):
        m.release(seq, Release.ERROR)
    _idle(m)


def test_a_page_aligned_parent_passes_each_child_its_reserved_growth_page() -> None:
    m = _manager()
    parent = _seq(range(1, 9), n=2)  # two full pages: each choice's first token starts a third
    _admit(m, parent)
    child = Sequence(parent.request, 1, list(parent.token_ids), 8, 0)
    m.fork(parent, child, 8)
    assert child.pages == parent.pages and (parent.reserved, child.reserved) == (1, 1)
    assert m.take_plan().page_copies == ()
    for seq in (parent, child):
        seq.token_ids.append(7)
        assert m.grow(seq) and seq.reserved == 0
    assert parent.pages[2] != child.pages[2] and m.pool.num_reserved == 0
    m.check([parent, child], [])
    m.release(parent, Release.FINISH)
    m.release(child, Release.FINISH)
    _idle(m)


# ---------------------------------------------------------------------------- window pages
def test_window_pages_behind_every_later_query_are_trimmed_and_still_serve_reuse() -> None:
    window = WindowPages(PagePool(8, PAGE), 5)
    m = _manager(window=window)
    a = _seq(range(1, 22))  # 21 tokens: 6 pages
    _admit(m, a)
    assert m.coverable(a, 21) == 21
    m.cover(a, 21)
    assert len(a.window_pages) == 6 and NONE not in a.window_pages
    _computed(m, a)
    m.trim_windows([a])  # the next query (21) sees positions 17..21: pages 4 and 5
    assert a.window_pages[:4] == [NONE] * 4 and window.pool.ref_count.count(1) == 2
    m.check([a], [])
    m.release(a, Release.FINISH)
    b = _seq([*range(1, 21), 99])  # the same 20 tokens, then another: pages 0..4 match
    match = m.match(b)
    assert len(match.pages) == 5  # window page 4 (positions 16..19), all the first query reads, is cached
    assert b.window_pages == [NONE] * 4 + [window.pool.page_of(chain_of(b, 5, PAGE)[4])]
    m.pool.release(list(match.pages))
    window.release(b)
    assert sum(window.pool.ref_count) == 0


def test_a_short_window_pool_cuts_the_next_chunk() -> None:
    window = WindowPages(PagePool(2, PAGE), 64)
    m = _manager(window=window)
    a = _seq(range(1, 20))
    assert m.admit(a, lambda start: 19) is None  # its first chunk needs 5 window pages
    assert m.admit(a, lambda start: 8) == 0  # a chunk of 8 needs 2
    assert m.coverable(a, 19) == 8
    m.release(a, Release.FINISH)
    _idle(m)


# ---------------------------------------------------------------------------- state snapshots
def test_prefill_ends_at_snapshot_boundaries_whose_captures_register_once_the_step_ran() -> None:
    states = StatePool(2, 4)
    m = _manager(states=states, interval=8)
    a = _seq(range(1, 23))  # boundaries: 8, 16 and 20 (the prompt's last page boundary)
    _admit(m, a)
    assert a.state_slot is not None
    assert m.cut_prefill(a, 22) == 8
    plan = m.take_plan()
    (capture,) = plan.captures
    assert plan.state_after == ((a.state_slot, capture.slot),) and capture.seq is a and not capture.anchor
    assert not states.has(capture.digest)
    m.step_ran(plan)
    _computed(m, a, 8)
    assert states.has(capture.digest) and capture.digest == a.chain[-1]
    assert m.cut_prefill(a, 22) == 16
    m.step_failed(m.take_plan())  # the step did not run: its slot goes back unregistered
    assert states.snapshots_held == 1
    m.check([a], [])
    m.release(a, Release.FINISH)
    match = m.match(_seq([*range(1, 19), 90, 91, 92]))  # 18 shared tokens; a committed 8 of them
    assert len(match.pages) == 2 and match.snapshot == capture.slot
    m.pool.release(list(match.pages))
    _idle(m)
    states.check(0)


def test_a_shared_prefix_resumes_from_the_longest_snapshot_restored_before_the_step() -> None:
    states = StatePool(2, 4)
    m = _manager(states=states, interval=8)
    a = _seq(range(1, 23))
    _admit(m, a)
    for end in (8, 16):
        assert m.cut_prefill(a, 22) == end
        m.step_ran(m.take_plan())
        _computed(m, a, end)
    m.release(a, Release.FINISH)
    b = _seq([*range(1, 13), 80, 81, 82, 83, 84, 85])  # 12 shared tokens: 3 pages, a snapshot at 8
    assert _admit(m, b) == 8 and len(b.chain) == 2
    plan = m.take_plan()
    assert len(plan.state_before) == 1 and plan.state_before[0][1] == b.state_slot
    assert plan.state_before[0][0] >= states.num_live  # from a snapshot slot
    m.check([b], [])
    m.release(b, Release.FINISH)
    states.check(0)


def test_a_decoding_endpoint_is_registered_at_finish_and_returned_on_error() -> None:
    for how, kept in ((Release.FINISH, True), (Release.PREEMPT, True), (Release.ERROR, False)):
        states = StatePool(1, 2)
        m = _manager(states=states)
        a = _seq(range(1, 9))  # decoding position 7: the step ends on the page boundary at 8
        _admit(m, a)
        _computed(m, a, 7)
        m.decoding(a)
        assert a.endpoint_slot is not None and m.take_plan().state_after == ((a.state_slot, a.endpoint_slot),)
        digest = a.endpoint_digest
        assert digest is not None
        m.release(a, how)
        assert states.has(digest) is kept and a.endpoint_slot is None and a.state_slot is None
        states.check(0)


def test_drafts_borrow_a_rollback_slot_that_a_rejection_makes_live() -> None:
    states = StatePool(1, 0, num_spare=1)
    m = _manager(states=states)
    a = _seq(range(1, 6))
    _admit(m, a)
    _computed(m, a, 5)
    a.token_ids.append(6)  # decoding position 5; the next page boundary is 8
    assert m.draft_room(a) == 1  # short of the boundary, leaving the correction token's position
    live = a.state_slot
    assert m.draft_pages(a, 1, keep_free=0) == 1 and a.rollback_slot is not None
    rollback = a.rollback_slot
    assert m.take_plan().state_before == ((live, rollback),)
    assert m.draft_room(_seq(range(1, 3))) == 0  # the spare slot is lent
    assert m.settle_round(a, rejected=True)  # the live state absorbed a rejected draft
    assert a.state_slot == rollback and a.rollback_slot is None and states.num_borrowed == 0
    m.check([a], [])
    m.release(a, Release.FINISH)
    states.check(0)


def test_draft_pages_come_from_free_pages_only() -> None:
    m = _manager(pages=4)
    a = _seq(range(1, 6))  # 2 pages; room for 3 drafts in the second
    _admit(m, a)
    assert m.draft_pages(a, 6, keep_free=2) == 3 and len(a.pages) == 2  # 2 left, both kept for growth
    assert m.draft_pages(a, 6, keep_free=0) == 6 and len(a.pages) == 3
    m.release(a, Release.FINISH)
    _idle(m)


# ---------------------------------------------------------------------------- host store
def _host_with(seq: Sequence, pages: int) -> tuple[HostStore, list[bytes]]:
    host = HostStore(b"i" * 32, 1 << 20, None, 0)
    digests, parent = [], ROOT_HASH
    for index in range(pages):
        tokens = tuple(seq.token_ids[index * PAGE : (index + 1) * PAGE])
        digest = page_hash(parent, seq.request.page_identity(index, PAGE), tokens)
        host.put([Record(digest, parent, tokens, torch.full((PAGE_BYTES,), index, dtype=torch.uint8))])
        digests.append(digest)
        parent = digest
    return host, digests


def test_admission_restores_the_host_stores_pages_after_the_pools_match() -> None:
    a = _seq(range(1, 11))
    host, digests = _host_with(a, 2)
    m = _manager(host=host)
    assert _admit(m, a) == 8 and a.chain == digests
    plan = m.take_plan()
    assert [page for page, _ in plan.host_in] == a.pages[:2]
    assert [int(payload[0]) for _, payload in plan.host_in] == [0, 1]  # type: ignore[index]
    assert m.pool.page_of(digests[0]) == a.pages[0]  # published at once
    assert host.stats.hits == 1 and host.stats.reused_tokens == 8 and host.stats.bytes_in == 2 * PAGE_BYTES
    assert m.stats.reused_tokens == 0  # api.md reused_tokens: device prefix-cache hits only
    m.release(a, Release.FINISH)
    _idle(m)


def test_a_finished_prefix_is_pinned_for_the_copier_and_admission_under_pressure_reclaims_it() -> None:
    host = HostStore(b"i" * 32, 1 << 20, None, 0)
    caches = torch.arange(4 * PAGE_BYTES, dtype=torch.uint8).reshape(4, PAGE_BYTES)
    copier = Copier(host, [caches], [])
    try:
        m = _manager(pages=4, host=host, copier=copier)
        a = _seq(range(1, 11))
        _admit(m, a)
        _computed(m, a)
        m.release(a, Release.FINISH)
        assert m.copy_out.pinned_records == 2 and sum(m.pool.ref_count) == 2  # pinned, not yet copied
        m.check([], [])
        b = _seq(range(50, 64), name="b")  # 4 pages: only with the pins released
        assert _admit(m, b) == 0 and m.copy_out.pinned_records == 0
        assert all(host.contains(d) for d in a.chain) and host.stats.copy_waits == 1
        m.release(b, Release.ERROR)  # a failed sequence is not offered
        assert m.copy_out.pinned_records == 0
        _idle(m)
    finally:
        copier.close()
