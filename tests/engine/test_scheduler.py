"""The scheduler fed hand-made model outputs (no model): chunking, admission, reservations,
forking, preemption, finishes, and the page invariants after each step."""

from __future__ import annotations

import random

from helios.engine.memory.kv_cache import PagePool
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import SamplingParams
from helios.engine.scheduler import Scheduler, SchedulerConfig
from helios.engine.sequence import ModelOutput, SampledToken, SchedulerOutput

PARAMS = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
PAGE = 4


def _request(name: str, length: int, n: int = 1, max_tokens: int = 8, **kwargs) -> EngineRequest:
    return EngineRequest(name, tuple(range(1, length + 1)), (PARAMS,) * n, max_tokens=max_tokens, **kwargs)


def _scheduler(pages: int = 16, chunk: int = 8, concurrency: int = 4, max_len: int = 1024) -> Scheduler:
    return Scheduler(SchedulerConfig(concurrency, chunk, max_len), PagePool(pages, PAGE))


def _step(s: Scheduler, token: int = 7, fail: bool = False) -> tuple[SchedulerOutput, list]:
    """Plan a step and feed back `token` for every sampled sequence (or fail the step)."""
    plan = s.schedule()
    events = list(plan.finished)
    if fail:
        events += s.fail(plan, "boom")
    else:
        tokens = {id(q): (SampledToken(token, None),) for c in plan.chunks if c.wants_logits for q in c.choices}
        events += s.update_from_output(plan, ModelOutput(tokens))
    s.check_invariants()
    return plan, events


def _collect(out: dict[tuple[str, int], list], events: list) -> None:
    for e in events:
        entry = out.setdefault((e.request_id, e.choice_index), [[], None])
        assert entry[1] is None, "an event after the choice finished"
        entry[0] += e.token_ids
        entry[1] = e.finish


def _run(
    s: Scheduler, limit: int = 10_000, out: dict | None = None
) -> dict[tuple[str, int], tuple[list[int], FinishCause]]:
    """Step until idle; every choice's tokens and finish (added to `out`'s earlier events)."""
    out = {} if out is None else out
    for _ in range(limit):
        if not s.has_work:
            break
        _collect(out, _step(s)[1])
    assert not s.has_work, "the scheduler did not drain"
    return {k: (v[0], v[1]) for k, v in out.items()}


def _idle(s: Scheduler) -> None:
    assert sum(s.pool.ref_count) == 0 and s.pool.num_reserved == 0
    assert s.pool.num_free + s.pool.num_cached == s.pool.num_pages


def test_prefill_is_chunked_and_mixed_with_decode() -> None:
    s = _scheduler(chunk=8)
    s.add(_request("a", 3))
    plan, _ = _step(s)
    assert [(c.start, c.num_tokens, c.wants_logits) for c in plan.chunks] == [(0, 3, True)]
    s.add(_request("b", 20))
    plan, _ = _step(s)
    # a decodes one token; b gets the rest of the 8-token prefill budget
    assert [(c.seq.request.request_id, c.num_tokens, c.wants_logits) for c in plan.chunks] == [
        ("a", 1, True),
        ("b", 8, False),
    ]
    plan, _ = _step(s)
    assert [(c.seq.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 4, 1), ("b", 8, 8)]


def test_admission_waits_for_pages_and_concurrency() -> None:
    s = _scheduler(pages=5, chunk=64, concurrency=4)
    s.add(_request("big", 12))  # 3 pages + a reserved growth page
    s.add(_request("next", 8))  # 2 pages + growth: must wait
    plan, _ = _step(s)
    assert [c.seq.request.request_id for c in plan.chunks] == ["big"] and len(s.waiting) == 1
    assert s.pool.num_reserved == 1  # 12 tokens fill 3 pages: the first output token needs a 4th
    s.abort({("big", None)})
    assert [c.seq.request.request_id for c in s.schedule().chunks] == ["next"]


def test_n_children_are_forked_from_reserved_pages_when_prefill_ends() -> None:
    s = _scheduler(pages=16, chunk=64)
    s.add(_request("a", 6, n=3))  # 1 full page + a partial page; 2 children reserved
    assert s.min_pages(s.waiting[0].request) == 1 + 3
    plan, _ = _step(s)
    chunk = plan.chunks[0]
    parent, *children = chunk.choices
    assert [c.choice_index for c in chunk.choices] == [0, 1, 2] and s.pool.num_reserved == 0
    full, partial = parent.pages
    assert all(c.pages[0] == full for c in children) and s.pool.ref_count[full] == 3
    assert [src for src, _ in plan.memory.page_copies] == [partial, partial]
    assert {dst for _, dst in plan.memory.page_copies} == {c.pages[1] for c in children}
    assert all(c.token_ids[-1] == 7 and c.num_pending == 1 for c in chunk.choices)
    s.abort({("a", None)})
    _idle(s)


def test_page_aligned_prompt_reserves_one_growth_page_per_choice() -> None:
    s = _scheduler(pages=16, chunk=64)
    s.add(_request("a", 8, n=2))  # exactly two pages: each choice's first token starts a third
    plan, _ = _step(s)
    parent, child = plan.chunks[0].choices
    assert plan.memory.page_copies == () and child.pages == parent.pages and (parent.reserved, child.reserved) == (1, 1)
    plan, _ = _step(s)
    assert len(parent.pages) == 3 and len(child.pages) == 3 and parent.pages[2] != child.pages[2]
    assert s.pool.num_reserved == 0


def test_choices_over_the_concurrency_limit_never_block_the_queue_when_refused_upstream() -> None:
    s = _scheduler(concurrency=4)
    assert s.min_pages(_request("x", 5, n=4)) == 1 + 4
    s.add(_request("a", 3, n=3))
    s.add(_request("b", 3, n=2))  # 3 + 2 > 4: waits for a to finish, then runs
    out = _run(s)
    assert sorted(out) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert all(cause is FinishCause.LENGTH and len(tokens) == 8 for tokens, cause in out.values())
    _idle(s)


def test_growth_preempts_the_newest_and_nobody_loses_output() -> None:
    s = _scheduler(pages=6, chunk=64, concurrency=8)
    for name in "abc":
        s.add(_request(name, 4, max_tokens=12))  # 16 tokens each: 4 pages each alone
    out = _run(s)
    assert s.stats.preemptions > 0
    assert {k: (len(t), c) for k, (t, c) in out.items()} == {(n, 0): (12, FinishCause.LENGTH) for n in "abc"}
    _idle(s)


def test_only_a_sequence_that_alone_fills_the_pool_stops_for_capacity() -> None:
    s = _scheduler(pages=3, chunk=64)
    s.add(_request("huge", 4, max_tokens=100))
    s.add(_request("small", 2, max_tokens=3))
    out = _run(s)
    tokens, cause = out[("huge", 0)]
    # Every slot of the pool holds a token's KV; the last sampled token needs none.
    assert cause is FinishCause.LENGTH and len(tokens) == 3 * PAGE - 4 + 1
    assert out[("small", 0)][1] is FinishCause.LENGTH and len(out[("small", 0)][0]) == 3
    _idle(s)


def test_preempted_sequences_are_readmitted_first_and_reuse_published_pages() -> None:
    s = _scheduler(pages=5, chunk=64, concurrency=8)
    s.add(_request("old", 4, max_tokens=10))
    s.add(_request("new", 4, max_tokens=10))
    reused_before = s.stats.reused_tokens
    while s.stats.preemptions == 0:
        _step(s)
    victim = s.waiting[0]
    assert victim.request.request_id == "new" and victim.pages == [] and victim.num_output > 0
    s.add(_request("later", 2, max_tokens=2))
    order, readmitted_at = [], None
    while s.has_work:
        plan, _ = _step(s)
        order += [c.seq.request.request_id for c in plan.chunks if c.start == 0 or c.seq.num_cached < c.start]
        if readmitted_at is None:
            readmitted_at = next((c.start for c in plan.chunks if c.seq is victim), None)
    assert order.index("new") < order.index("later")
    assert readmitted_at is not None and readmitted_at > 0  # the victim's full pages came back from the cache
    assert s.stats.reused_tokens == reused_before  # api.md: hits count once per admission, not at readmission
    _idle(s)


def test_failed_step_fails_only_its_sequences() -> None:
    s = _scheduler(pages=16, chunk=64)
    s.add(_request("a", 3))
    _step(s)
    s.add(_request("b", 3, n=2))  # fails during its prefill: both of its choices fail
    s.add(_request("c", 40))  # waits: no budget this step (chunk=64 is not exhausted, but pages are)
    plan, events = _step(s, fail=True)
    failed = {(e.request_id, e.choice_index) for e in events if e.finish is FinishCause.ERROR}
    planned = {(q.request.request_id, q.choice_index) for c in plan.chunks for q in c.choices}
    assert failed == planned and ("b", 1) in failed
    assert s.stats.failed == len(failed)
    _run(s)
    _idle(s)


def test_abort_of_a_waiting_request_with_unforked_children_finishes_every_choice() -> None:
    s = _scheduler(pages=2, chunk=64)
    s.add(_request("a", 4, max_tokens=2))
    s.add(_request("b", 2, n=2))
    _step(s)
    events = s.abort({("b", None)})
    assert sorted((e.choice_index, e.finish) for e in events) == [(0, FinishCause.ABORT), (1, FinishCause.ABORT)]
    _run(s)
    _idle(s)


def test_prompt_scoring_only_finishes_every_choice_without_output() -> None:
    s = _scheduler(pages=16, chunk=64)
    s.add(_request("score", 5, n=2, max_tokens=0, prompt_logprobs=0))
    out = _run(s)
    assert out == {("score", 0): ([], FinishCause.LENGTH), ("score", 1): ([], FinishCause.LENGTH)}
    _idle(s)


def test_randomized_schedules_keep_every_invariant() -> None:
    rng = random.Random(1234)
    for trial in range(20):
        pages = rng.randint(6, 24)
        s = _scheduler(pages=pages, chunk=rng.choice([4, 8, 64]), concurrency=rng.randint(2, 8), max_len=64)
        expected: dict[tuple[str, int], tuple[int, int]] = {}  # (prompt length, max_tokens)
        aborted: set[str] = set()
        seen: dict = {}
        for step in range(400):
            if rng.random() < 0.3:
                name, n = f"r{trial}.{step}", rng.randint(1, 2)
                length, max_tokens = rng.randint(1, 12), rng.randint(1, 20)
                request = _request(name, length, n=n, max_tokens=max_tokens)
                if s.min_pages(request) <= pages and n <= s.config.max_concurrency:
                    s.add(request)
                    expected.update({(name, i): (length, max_tokens) for i in range(n)})
            if expected and rng.random() < 0.05:
                victim = rng.choice(sorted(expected))[0]
                _collect(seen, s.abort({(victim, None)}))
                aborted.add(victim)
            _collect(seen, _step(s)[1])
        out = _run(s, out=seen)
        for (name, index), (tokens, cause) in out.items():
            if cause is FinishCause.ABORT:
                assert name in aborted
                continue
            length, max_tokens = expected[(name, index)]
            assert cause is FinishCause.LENGTH
            if len(tokens) < max_tokens:  # capacity: only when the sequence alone fills the pool or context
                assert length + len(tokens) >= min(64, pages * PAGE), (name, index, length, len(tokens))
        _idle(s)


def test_scored_prefill_records_where_each_chunk_ended() -> None:
    s = _scheduler(pages=16, chunk=4)
    s.add(_request("other", 3))
    s.add(_request("scored", 10, max_tokens=1, prompt_logprobs=0))
    events = []
    while s.has_work:  # "other" takes 3 of the first step's 4 prefill tokens: chunks are 1, 4, 4, 1
        plan = s.schedule()
        entries = {id(c): [None] * c.num_tokens for c in plan.chunks if c.scored}
        tokens = {id(q): (SampledToken(7, None),) for c in plan.chunks if c.wants_logits for q in c.choices}
        events += s.update_from_output(plan, ModelOutput(tokens, {}, entries))
    first = next(e for e in events if e.request_id == "scored")
    assert first.prompt_chunk_ends == (1, 5, 9, 10)
