"""The scheduler fed by hand (no model): chunking, admission, capacity, forking."""

from __future__ import annotations

from helios.engine.kv_cache import BlockManager
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import SamplingParams
from helios.engine.scheduler import Scheduler, SchedulerConfig

PARAMS = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)


def _request(name: str, length: int, n: int = 1) -> EngineRequest:
    return EngineRequest(name, tuple(range(1, length + 1)), (PARAMS,) * n, max_tokens=8)


def _scheduler(pages: int = 16, chunk: int = 8, concurrency: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(concurrency, 16, chunk, 1024), BlockManager(pages, 4))


def _complete(scheduler: Scheduler, plan, next_token: int = 7) -> None:
    """Pretend the model ran: advance computed counts and sample one token where asked."""
    for chunk in plan.chunks:
        chunk.seq.num_computed += chunk.num_tokens
        scheduler.publish_full_pages(chunk.seq)
        if chunk.wants_logits:
            chunk.seq.token_ids.append(next_token)


def test_prefill_is_chunked_and_mixed_with_decode() -> None:
    s = _scheduler(chunk=8)
    s.add(_request("a", 3))
    plan = s.schedule()
    assert [(c.start, c.num_tokens, c.wants_logits) for c in plan.chunks] == [(0, 3, True)]
    _complete(s, plan)
    s.add(_request("b", 20))
    plan = s.schedule()
    # a decodes one token; b gets the rest of the 8-token prefill budget
    assert [(c.seq.request.request_id, c.num_tokens, c.wants_logits) for c in plan.chunks] == [("a", 1, True), ("b", 8, False)]
    _complete(s, plan)
    plan = s.schedule()
    assert [(c.seq.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 4, 1), ("b", 8, 8)]


def test_admission_waits_for_pages_and_concurrency() -> None:
    s = _scheduler(pages=4, chunk=64, concurrency=4)
    s.add(_request("big", 12))  # 3 pages
    s.add(_request("next", 8))  # 2 pages: must wait
    plan = s.schedule()
    assert [c.seq.request.request_id for c in plan.chunks] == ["big"] and len(s.waiting) == 1
    s.finish(plan.chunks[0].seq, FinishCause.EOS)
    assert [c.seq.request.request_id for c in s.schedule().chunks] == ["next"]


def test_sequence_that_cannot_grow_is_reported() -> None:
    s = _scheduler(pages=2, chunk=64)
    s.add(_request("a", 8))  # fills both pages exactly
    plan = s.schedule()
    _complete(s, plan)
    plan = s.schedule()  # token 9 needs a third page
    assert plan.chunks == () and [q.request.request_id for q in plan.out_of_pages] == ["a"]


def test_prefix_reuse_reports_cached_tokens_and_leaves_one_token_to_compute() -> None:
    s = _scheduler(pages=16, chunk=64)
    s.add(_request("a", 8))
    plan = s.schedule()
    _complete(s, plan)
    s.finish(plan.chunks[0].seq, FinishCause.EOS)
    s.add(_request("same", 8))
    plan = s.schedule()
    chunk = plan.chunks[0]
    # 8 tokens = 2 full pages, but the last token must run to give logits: 1 page reused.
    assert chunk.seq.num_cached == 4 and (chunk.start, chunk.num_tokens) == (4, 4)


def test_fork_shares_full_pages_and_copies_the_partial_one() -> None:
    s = _scheduler(pages=16, chunk=64)
    s.add(_request("a", 6, n=3))
    plan = s.schedule()
    _complete(s, plan)
    copies = []
    parent = plan.chunks[0].seq
    children = s.fork(parent, lambda src, dst: copies.append((src, dst)))
    assert [c.choice_index for c in children] == [1, 2]
    full, partial = parent.block_table
    assert all(c.block_table[0] == full for c in children)
    assert s.blocks.ref_count[full] == 3
    assert [src for src, _ in copies] == [partial, partial] and len({dst for _, dst in copies}) == 2
    for seq in [parent, *children]:
        s.finish(seq, FinishCause.EOS)
    assert s.blocks.num_free == 16
