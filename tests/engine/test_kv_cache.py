"""Page accounting and the prefix cache, without a model."""

from __future__ import annotations

import pytest

from helios.engine.kv_cache import ROOT_HASH, BlockManager, OutOfPages


def _publish_all(blocks: BlockManager, pages: list[int], tokens: tuple[int, ...], identity: bytes = b"") -> None:
    parent = ROOT_HASH
    size = blocks.page_tokens
    for index, page in enumerate(pages):
        parent = blocks.publish(page, parent, identity, tokens[index * size : (index + 1) * size])


def test_prefix_hit_shares_pages_and_stops_at_first_difference() -> None:
    blocks = BlockManager(8, 4)
    tokens = tuple(range(12))
    pages = [blocks.allocate() for _ in range(3)]
    _publish_all(blocks, pages, tokens)
    hit, _ = blocks.match_prefix(tokens, b"", max_pages=3)
    assert hit == pages and all(blocks.ref_count[p] == 2 for p in pages)
    changed = tokens[:5] + (99,) + tokens[6:]
    hit2, _ = blocks.match_prefix(changed, b"", max_pages=3)
    assert hit2 == pages[:1]  # the second page differs, so the chain stops there
    assert blocks.match_prefix(tokens, b"other-image", max_pages=3)[0] == []  # identity slot


def test_unreferenced_cached_pages_are_evicted_lru() -> None:
    blocks = BlockManager(3, 2)
    a, b = blocks.allocate(), blocks.allocate()
    _publish_all(blocks, [a], (1, 2))
    _publish_all(blocks, [b], (3, 4))
    blocks.release([a])
    blocks.release([b])
    assert blocks.num_free == 3 and blocks.num_cached == 2
    blocks.match_prefix((1, 2), b"", 1)  # touch a: b becomes the oldest
    blocks.release([a])
    blocks.allocate()  # the never-used page
    evicted = blocks.allocate()
    assert evicted == b and blocks.match_prefix((3, 4), b"", 1)[0] == []
    assert blocks.match_prefix((1, 2), b"", 1)[0] == [a]


def test_out_of_pages_and_no_double_release() -> None:
    blocks = BlockManager(1, 4)
    page = blocks.allocate()
    with pytest.raises(OutOfPages):
        blocks.allocate()
    blocks.release([page])
    with pytest.raises(AssertionError):
        blocks.release([page])


def test_duplicate_publish_keeps_the_first_page() -> None:
    blocks = BlockManager(4, 2)
    first, second = blocks.allocate(), blocks.allocate()
    _publish_all(blocks, [first], (5, 6))
    _publish_all(blocks, [second], (5, 6))
    blocks.release([second])
    assert blocks.num_cached == 1 and blocks.match_prefix((5, 6), b"", 1)[0] == [first]
