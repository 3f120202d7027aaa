"""Page-hash chains of a sequence's tokens: the keys its prefix is cached under in the page pool,
the window pool, the state snapshots and the host store."""

from __future__ import annotations

from helios.engine.memory.kv_cache import ROOT_HASH, page_hash
from helios.engine.sequence import Sequence


def page_tokens_of(seq: Sequence, index: int, size: int) -> tuple[int, ...]:
    return tuple(seq.token_ids[index * size : (index + 1) * size])


def chain_of(seq: Sequence, num_pages: int, size: int) -> list[bytes]:
    """The chain hash of each of seq's first `num_pages` full pages."""
    chain, parent = [], ROOT_HASH
    for index in range(num_pages):
        parent = page_hash(parent, seq.request.page_identity(index, size), page_tokens_of(seq, index, size))
        chain.append(parent)
    return chain


def digest_at(seq: Sequence, boundary: int, size: int) -> bytes:
    """The chain hash of seq's tokens up to a page boundary (its published chain, extended)."""
    digest = seq.chain[-1] if seq.chain else ROOT_HASH
    for index in range(len(seq.chain), boundary // size):
        digest = page_hash(digest, seq.request.page_identity(index, size), page_tokens_of(seq, index, size))
    return digest
