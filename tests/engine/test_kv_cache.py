"""Page accounting and the prefix cache, without a model."""

from __future__ import annotations

import pytest

from helios.engine.memory.kv_cache import ROOT_HASH, OutOfPages, PagePool


def _publish_all(pool: PagePool, pages: list[int], tokens: tuple[int, ...], identity: bytes = b"") -> None:
    parent = ROOT_HASH
    size = pool.page_tokens
    for index, page in enumerate(pages):
        parent = pool.publish(page, parent, identity, tokens[index * size : (index + 1) * size])


def _two_published(pages: int, first: tuple[int, int], second: tuple[int, int]) -> tuple[PagePool, int, int]:
    """A pool of `pages` two-token pages, two of them allocated and published: (pool, the page
    holding `first`, the page holding `second`)."""
    pool = PagePool(pages, 2)
    a, b = pool.allocate(), pool.allocate()
    _publish_all(pool, [a], first)
    _publish_all(pool, [b], second)
    return pool, a, b


def test_prefix_hit_shares_pages_and_stops_at_first_difference() -> None:
    pool = PagePool(8, 4)
    tokens = tuple(range(12))
    pages = [pool.allocate() for _ in range(3)]
    _publish_all(pool, pages, tokens)
    hit, _ = pool.match_prefix(tokens, b"", max_pages=3)
    assert hit == pages and all(pool.ref_count[p] == 2 for p in pages)
    changed = tokens[:5] + (99,) + tokens[6:]
    hit2, _ = pool.match_prefix(changed, b"", max_pages=3)
    assert hit2 == pages[:1]  # the second page differs, so the chain stops there
    assert pool.match_prefix(tokens, b"other-image", max_pages=3)[0] == []  # identity slot


def test_unreferenced_cached_pages_are_evicted_lru() -> None:
    pool, a, b = _two_published(3, (1, 2), (3, 4))
    pool.release([a])
    pool.release([b])
    assert pool.num_free == 1 and pool.num_cached == 2 and pool.num_available == 3
    pool.match_prefix((1, 2), b"", 1)  # touch a: b becomes the oldest
    pool.release([a])
    pool.allocate()  # the never-used page
    evicted = pool.allocate()
    assert evicted == b and pool.match_prefix((3, 4), b"", 1)[0] == []
    assert pool.match_prefix((1, 2), b"", 1)[0] == [a]


def test_out_of_pages_and_no_double_release() -> None:
    pool = PagePool(1, 4)
    page = pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.release([page])
    with pytest.raises(AssertionError):
        pool.release([page])


def test_duplicate_publish_keeps_the_first_page() -> None:
    pool, first, second = _two_published(4, (5, 6), (5, 6))
    pool.release([second])
    assert pool.num_cached == 1 and pool.match_prefix((5, 6), b"", 1)[0] == [first]
