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

Sizing: a sequence holds at most pages_per_sequence() pages at once (the window behind its next
query plus one step's tokens), and at most max_concurrency sequences run, so a pool of
max_concurrency * pages_per_sequence() pages never runs out; unreferenced cached pages are
evicted for new ones as in the main pool.
"""

from __future__ import annotations

from helios.engine.kv_cache import OutOfPages, PagePool
from helios.engine.sequence import Sequence

NONE = -1  # a window table entry holding no page (reclaimed, or not needed yet)


def pages_per_sequence(window: int, page_tokens: int, step_tokens: int) -> int:
    """The most window pages one sequence holds at once: the window behind its next query (window - 1
    positions) plus one step's tokens (a prefill chunk, or a decode token and its drafts), each
    span straddling at most one page boundary more than its length needs."""
    return -(-max(0, window - 1) // page_tokens) + -(-max(1, step_tokens) // page_tokens) + 2


class WindowPages:
    def __init__(self, pool: PagePool, window: int) -> None:
        self.pool = pool
        self.window = window
        self.page_tokens = pool.page_tokens

    def first_needed(self, position: int) -> int:
        """The first logical page a query at `position` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.page_tokens

    # ------------------------------------------------------------------ a step's pages
    def cover(self, seq: Sequence, end: int) -> None:
        """Window pages for every position seq's next step writes, [num_computed, end)."""
        table, size = seq.window_pages, self.page_tokens
        while len(table) < -(-end // size):
            table.append(NONE)
        for index in range(seq.num_computed // size, -(-end // size)):
            if table[index] == NONE:
                try:
                    table[index] = self.pool.allocate()
                except OutOfPages:  # pages_per_sequence bounds what running sequences hold
                    raise RuntimeError(f"the window pool ({self.pool.num_pages} pages) ran out; "
                                       "it is sized for max_concurrency sequences") from None  # fmt: skip

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
        if len(parent.window_pages) > full and parent.window_pages[full] != NONE:
            page = self.pool.allocate()
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
