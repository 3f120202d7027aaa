"""Paged KV page accounting with a prefix cache and reservations (page ids only, no tensors).

Full pages are identified by a chained hash of (parent hash, identity slot, page tokens).
A published page is immutable and may be shared by many sequences; once unreferenced it
stays cached until least-recently-used eviction hands it out again. Every hit is checked
against the stored tokens, so reuse is exact.

Every page is in exactly one of three states, which partition the pool:
  free    unreferenced, holding no published prefix
  cached  holding a published prefix (referenced by running sequences or not)
  private referenced, unpublished (a sequence's partial or not-yet-published page)
Reserved pages are a promise, not a state: `num_reserved` of the allocatable pages (free
plus unreferenced cached) are held back for admitted sequences and only they may take them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

ROOT_HASH = b"flare-prefix-v1"


def page_hash(parent: bytes, identity: bytes, tokens: tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(len(identity).to_bytes(4, "little") + identity)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return digest.digest()


@dataclass(slots=True)
class _Cached:
    hash: bytes
    tokens: tuple[int, ...]  # exactly page_tokens tokens
    parent: bytes


class OutOfPages(Exception):
    """No unreserved free or evictable page is left."""


class PagePool:
    def __init__(self, num_pages: int, page_tokens: int) -> None:
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.ref_count = [0] * num_pages
        self.num_reserved = 0  # invariant: num_reserved <= len(_free) + len(_evictable)
        self._free: deque[int] = deque(range(num_pages))  # never cached, or evicted
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._by_hash: dict[bytes, int] = {}
        self._cached: dict[int, _Cached] = {}

    # ------------------------------------------------------------------ accounting
    @property
    def num_available(self) -> int:
        """Pages an unreserved allocation may take now (free plus evictable, minus reservations)."""
        return len(self._free) + len(self._evictable) - self.num_reserved

    @property
    def num_free(self) -> int:
        """Unreferenced pages holding no published prefix."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages holding a published prefix, referenced or not."""
        return len(self._cached)

    @property
    def num_private(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    # ------------------------------------------------------------------ reservations
    def reserve(self, count: int) -> bool:
        """Hold back `count` allocatable pages; False (nothing held) when too few are left."""
        if count > self.num_available:
            return False
        self.num_reserved += count
        return True

    def unreserve(self, count: int) -> None:
        assert 0 <= count <= self.num_reserved, f"unreserving {count} of {self.num_reserved} reserved pages"
        self.num_reserved -= count

    # ------------------------------------------------------------------ allocation
    def allocate(self, reserved: bool = False) -> int:
        """One page; `reserved` takes it out of an earlier reservation (which cannot fail)."""
        if reserved:
            self.unreserve(1)
        elif self.num_available < 1:
            raise OutOfPages
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            entry = self._cached.pop(page)
            del self._by_hash[entry.hash]
        self.ref_count[page] = 1
        return page

    def share(self, page: int) -> None:
        if self.ref_count[page] == 0:
            self._evictable.pop(page, None)
        self.ref_count[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.ref_count[page] -= 1
            assert self.ref_count[page] >= 0, f"page {page} released twice"
            if self.ref_count[page] == 0:
                if page in self._cached:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(
        self, tokens: tuple[int, ...] | list[int], identity: bytes | Callable[[int], bytes], max_pages: int
    ) -> tuple[list[int], bytes]:
        """Cached pages covering the longest full-page prefix of `tokens` (at most max_pages).
        `identity`: one slot for every page, or page index -> its slot (EngineRequest.page_identity).

        Returns (pages, chain hash after them). The pages are shared (ref-counted) on return.
        """
        slot = identity if callable(identity) else (lambda index: identity)
        pages: list[int] = []
        parent = ROOT_HASH
        size = self.page_tokens
        for index in range(min(max_pages, len(tokens) // size)):
            chunk = tuple(tokens[index * size : (index + 1) * size])
            digest = page_hash(parent, slot(index), chunk)
            page = self._by_hash.get(digest)
            if page is None or self._cached[page].tokens != chunk or self._cached[page].parent != parent:
                break
            pages.append(page)
            parent = digest
        for page in pages:
            self.share(page)
            if page in self._evictable:  # keep LRU order meaningful for shared pages too
                self._evictable.move_to_end(page)
        return pages, parent

    def drop_cached(self) -> int:
        """Forget every unreferenced cached page (POST /flush_cache): they become free pages and no
        later lookup finds their prefixes. Pages running sequences share stay cached. Returns the
        count dropped."""
        dropped = list(self._evictable)
        self._evictable.clear()
        for page in dropped:
            del self._by_hash[self._cached.pop(page).hash]
        self._free.extend(dropped)
        return len(dropped)

    def cached_tokens(self, page: int) -> tuple[int, ...] | None:
        """The tokens a cached page holds (None: it holds no published prefix)."""
        entry = self._cached.get(page)
        return entry.tokens if entry is not None else None

    def page_of(self, digest: bytes) -> int | None:
        """The page holding the published prefix `digest`, if it is still cached."""
        return self._by_hash.get(digest)

    def publish(self, page: int, parent: bytes, identity: bytes, tokens: tuple[int, ...]) -> bytes:
        """Register a just-computed full page; returns its chain hash.

        If an identical page is already cached, this one stays private (and is freed normally).
        """
        digest = page_hash(parent, identity, tokens)
        if digest not in self._by_hash and page not in self._cached:
            self._by_hash[digest] = page
            self._cached[page] = _Cached(hash=digest, tokens=tokens, parent=parent)
        return digest
