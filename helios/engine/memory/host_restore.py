"""Admission's host-store lookup: a sequence's pages after the pool's match, filled from the host
store's records of the same chain (copied in before the step, published at once); a hybrid's only
as far as a state record reaches."""

from __future__ import annotations

from dataclasses import dataclass

from helios.engine.memory.chains import page_tokens_of
from helios.engine.memory.host_store import HostStore, state_key
from helios.engine.memory.kv_cache import PagePool, page_hash
from helios.engine.memory.plan import PlanBuilder
from helios.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Restored:
    pages: int  # pages restored after the pool's match
    end: bytes  # the chain hash after them (the match's end when none)
    state: object | None  # hybrid cores: the state record's payload at that boundary (None: none restored)


def restore(
    host: HostStore,
    pool: PagePool,
    seq: Sequence,
    first: int,
    parent: bytes,
    page_bytes: int,
    state_bytes: int | None,
    plan: PlanBuilder,
) -> Restored:
    """Fill seq's pages from index `first` (its pool match ended at chain hash `parent`).
    `state_bytes`: a state record's payload size on hybrid cores, None on others."""
    size, tokens = pool.page_tokens, seq.token_ids
    found: list[tuple[bytes, bytes, bytes, tuple[int, ...], object]] = []  # (digest, parent, identity, tokens, payload)
    start = parent
    for index in range(first, (len(tokens) - 1) // size):  # the last token is always computed
        chunk = page_tokens_of(seq, index, size)
        identity = seq.request.page_identity(index, size)
        digest = page_hash(parent, identity, chunk)
        record = host.fetch(digest, parent, chunk)
        if record is None or record.nbytes != page_bytes:
            break
        found.append((digest, parent, identity, chunk, record.payload))
        parent = digest
    state = None
    if state_bytes is not None:  # the longest restored boundary with a state record
        while found and state is None:
            record = host.fetch(state_key(found[-1][0]), found[-1][0], ())
            if record is not None and record.nbytes == state_bytes:
                state = record.payload
            else:
                found.pop()
    for index, (_digest, previous, identity, chunk, payload) in enumerate(found, start=first):
        page = seq.pages[index]
        plan.host_in.append((page, payload))
        pool.publish(page, previous, identity, chunk)
    restored = len(found)
    stats = host.stats
    stats.bytes_in += restored * page_bytes + (state_bytes if state is not None and state_bytes is not None else 0)
    if restored:
        stats.hits += 1
        stats.reused_tokens += restored * size
    stats.missing_tokens.observe(len(tokens) - (first + restored) * size)
    if restored and host.copy_ns_per_byte and host.prefill_ns_per_token:
        stats.transfer_ns.observe(restored * page_bytes * host.copy_ns_per_byte)
        stats.prefill_ns.observe(restored * size * host.prefill_ns_per_token)
    return Restored(restored, found[-1][0] if found else start, state)
