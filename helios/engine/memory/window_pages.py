"""The window pool: sliding-window layers' pages, reclaimed behind the window (KvLayout.window_pool).

A core whose sliding layers keep their keys and values in a second pool gives each sequence a
second page table over the same logical pages (`Sequence.window_pages`, -1 where it holds none).
Only pages some query still to come can see are held: after every step, a page whose positions
are all at least `window` behind the next query (its last position + window <= num_computed) is
released. A long prompt's sliding layers therefore hold about window + one chunk of tokens,
whatever its length; the main pool still holds every position for the global layers.

Full window pages are published under the main pool's chain hashes, so a prefix the main pool
matches resumes only as far as the window pages its first query needs are still cached (the
last `window` - 1 positions before it); a shorter reuse is taken otherwise.

Sizing: the engine gives the pool as many pages as the main pool would have had for the same
memory (equal token capacity, so no workload holds fewer tokens than with one pool), but never
more than `pool_pages`, what max_concurrency sequences can hold at once; the memory saved goes
to the main pool. When the pool is short, the scheduler treats it as the main pool: a decoding
sequence preempts the newest ones, a prefill chunk is cut to the pages left, admission waits,
and forks take pages reserved at admission; unreferenced cached pages are evicted for new ones.
"""

from __future__ import annotations

from helios.engine.memory.kv_cache import OutOfPages, PagePool
from helios.engine.sequence import Sequence

NONE = -1  # a window table entry holding no page (reclaimed, or not needed yet)


def pool_pages(window: int, page_tokens: int, max_sequences: int, prefill_tokens: int, max_drafts: int) -> int:
    """Window pages that running sequences can hold at once: each its window behind the next query
    (window - 1 positions, straddling one more page) and the pages drafts began beyond it, plus the
    pages of one step's tokens: a decode token and its drafts per sequence, and the prefill budget
    shared by all (each chunk straddling one more page)."""

    def pages(tokens: int) -> int:
        return -(-max(0, tokens) // page_tokens)

    per_sequence = pages(window - 1) + 1 + pages(max_drafts) + pages(1 + max_drafts) + 1
    return max_sequences * per_sequence + pages(prefill_tokens)


def min_pool_pages(window: int, page_tokens: int, prefill_tokens: int) -> int:
    """Pages one sequence alone needs for a window and a full prefill chunk."""
    return -(-max(0, window - 1) // page_tokens) + -(-prefill_tokens // page_tokens) + 4


class WindowPages:
    def __init__(self, pool: PagePool, window: int) -> None:
        self.pool = pool
        self.window = window
        self.page_tokens = pool.page_tokens

    def first_needed(self, position: int) -> int:
        """The first logical page a query at `position` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.page_tokens

    # ------------------------------------------------------------------ a step's pages
    def needed(self, seq: Sequence, start: int, end: int) -> int:
        """Pages seq lacks for positions [start, end) (its next step's, from num_computed)."""
        table, size = seq.window_pages, self.page_tokens
        return sum(1 for index in range(start // size, -(-end // size)) if index >= len(table) or table[index] == NONE)

    def coverable(self, seq: Sequence, end: int) -> int:
        """The furthest end <= `end` whose pages the pool can give seq now."""
        size, table, left = self.page_tokens, seq.window_pages, self.pool.num_available
        for index in range(seq.num_computed // size, -(-end // size)):
            if index >= len(table) or table[index] == NONE:
                if left == 0:
                    return max(seq.num_computed, index * size)
                left -= 1
        return end

    def cover(self, seq: Sequence, end: int) -> bool:
        """Window pages for every position seq's next step writes, [num_computed, end); False (some
        taken, the rest not) when the pool has too few."""
        table, size = seq.window_pages, self.page_tokens
        while len(table) < -(-end // size):
            table.append(NONE)
        for index in range(seq.num_computed // size, -(-end // size)):
            if table[index] == NONE:
                try:
                    table[index] = self.pool.allocate()
                except OutOfPages:
                    return False
        return True

    def trim(self, seq: Sequence) -> None:
        """Release seq's pages no query still to come can see."""
        table = seq.window_pages
        for index in range(min(self.first_needed(seq.num_computed), len(table))):
            if table[index] != NONE:
                self.pool.release([table[index]])
                table[index] = NONE

    def release(self, seq: Sequence) -> None:
        self.pool.release([page for page in seq.window_pages if page != NONE])
        seq.window_pages = []
        self.pool.unreserve(seq.window_reserved)
        seq.window_reserved = 0

    def reserve_forks(self, seq: Sequence) -> bool:
        """At admission: one page for each unforked child's copy of the partial page."""
        if not self.pool.reserve(seq.unforked):
            return False
        seq.window_reserved = seq.unforked
        return True

    # ------------------------------------------------------------------ prefix reuse
    def publish(self, seq: Sequence, index: int, parent: bytes, identity: bytes, tokens: tuple[int, ...]) -> None:
        """Register logical page `index` (just published in the main pool under the same chain)."""
        if index < len(seq.window_pages) and seq.window_pages[index] != NONE:
            self.pool.publish(seq.window_pages[index], parent, identity, tokens)

    def reusable(self, seq: Sequence, chain: list[bytes], tokens: list[int]) -> int:
        """Of the `len(chain)` full pages the main pool matched, how many seq can resume after: the
        most whose window pages (the last window - 1 positions before them) are all still cached.
        Those window pages are taken (shared) into seq's table."""
        size = self.page_tokens
        for count in range(len(chain), 0, -1):
            needed = range(self.first_needed(count * size), count)
            pages = [self._cached(chain[i], tuple(tokens[i * size : (i + 1) * size])) for i in needed]
            if all(page is not None for page in pages):
                seq.window_pages = [NONE] * count
                for index, page in zip(needed, pages, strict=True):
                    self.pool.share(page)
                    seq.window_pages[index] = page
                return count
        return 0

    def _cached(self, digest: bytes, tokens: tuple[int, ...]) -> int | None:
        page = self.pool.page_of(digest)
        return page if page is not None and self.pool.cached_tokens(page) == tokens else None

    # ------------------------------------------------------------------ forks
    def fork(self, parent: Sequence, child: Sequence, full: int, copies: list[tuple[int, int]]) -> None:
        """The child shares the parent's window pages of its full pages and gets a copy of the
        partial one (copied after the step that writes it)."""
        child.window_pages = list(parent.window_pages[:full])
        for page in child.window_pages:
            if page != NONE:
                self.pool.share(page)
        if parent.window_reserved:
            parent.window_reserved -= 1
            self.pool.unreserve(1)
        if len(parent.window_pages) > full and parent.window_pages[full] != NONE:
            page = self.pool.allocate()  # the page just unreserved for it
            copies.append((parent.window_pages[full], page))
            child.window_pages.append(page)

    def refs(self, running: list[Sequence]) -> list[int]:
        """Expected reference counts of the window pool's pages (check_invariants)."""
        refs = [0] * self.pool.num_pages
        for seq in running:
            for page in seq.window_pages:
                if page != NONE:
                    refs[page] += 1
        return refs
