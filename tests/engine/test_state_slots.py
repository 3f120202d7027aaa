"""Recurrent-state slots of hybrid cores in the scheduler (no model): one live slot per running
sequence through admission, forks, preemption, aborts and failures; snapshots captured at
page-aligned prompt boundaries and restored for a shared prefix; never a stale slot."""

from __future__ import annotations

import random

from helios.engine.memory.kv_cache import PagePool
from helios.engine.memory.state_slots import StatePool
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.scheduler import Scheduler, SchedulerConfig
from helios.engine.sequence import ModelOutput, SampledToken
from tests.engine.test_scheduler import PAGE, PARAMS, _collect, _request, _step


def _hybrid(pages: int = 32, chunk: int = 16, concurrency: int = 4, snapshots: int = 4, interval: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(concurrency, chunk, 1024, snapshot_interval=interval),
        PagePool(pages, PAGE),
        states=StatePool(concurrency, snapshots),
    )


def _drain(s: Scheduler, fail_every: int = 0) -> dict:
    out: dict = {}
    for step in range(10_000):
        if not s.has_work:
            break
        _collect(out, _step(s, fail=bool(fail_every) and step % fail_every == fail_every - 1)[1])
    assert not s.has_work
    assert s.states is not None and s.states.live_in_use == 0
    return out


def test_prefill_chunks_end_at_snapshot_boundaries_and_capture_there() -> None:
    s = _hybrid(chunk=16, interval=8)
    s.add(_request("a", 22))  # boundaries: 8, 16 (interval) and 20 (the prompt's last page boundary)
    ends, captured = [], []
    while True:
        plan, _ = _step(s)
        chunk = plan.chunks[0]
        ends.append(chunk.start + chunk.num_tokens)
        captured += [(slot_src, slot_dst) for slot_src, slot_dst in plan.memory.state_after]
        assert [c[0] for c in plan.memory.captures] == [chunk.seq] * len(plan.memory.captures)
        if chunk.wants_logits:
            break
    assert ends == [8, 16, 20, 22]
    live = s.running[0].state_slot
    assert len(captured) == 3 and all(src == live and dst >= s.states.num_live for src, dst in captured)
    assert s.states.snapshots_held == 3


def test_a_shared_prefix_resumes_from_the_longest_snapshot() -> None:
    s = _hybrid(chunk=64, interval=8)
    s.add(_request("a", 30, max_tokens=1))
    _drain(s)  # captures at 8, 16, 24 and 28
    shared = tuple(range(1, 19)) + (99, 98, 97, 96, 95)  # the first 18 tokens, then different ones
    s.add(EngineRequest("b", shared, (PARAMS,), max_tokens=2))
    plan, _ = _step(s)
    seq = plan.chunks[0].seq
    assert plan.chunks[0].start == 16 and seq.num_cached == 16  # pages 0..3 match; the snapshot at 16 holds
    assert len(plan.memory.state_before) == 1 and plan.memory.state_before[0][1] == seq.state_slot
    assert plan.memory.state_before[0][0] >= s.states.num_live


def test_pages_without_a_snapshot_are_recomputed() -> None:
    s = _hybrid(chunk=64, snapshots=0)
    s.add(_request("a", 30, max_tokens=1))
    _drain(s)
    s.add(_request("b", 30, max_tokens=1))
    plan, _ = _step(s)
    assert plan.chunks[0].start == 0 and plan.chunks[0].seq.num_cached == 0 and not plan.memory.state_before


def test_forks_copy_the_parents_state_after_the_step() -> None:
    s = _hybrid()
    s.add(_request("n4", 6, n=4, max_tokens=3))
    plan, _ = _step(s)
    assert plan.chunks[0].num_tokens == 4 and plan.memory.captures  # up to the prompt's last page boundary
    plan, _ = _step(s)
    parent = plan.chunks[0].seq
    forks = [(src, dst) for src, dst in plan.memory.state_after if dst < s.states.num_live]
    assert len(forks) == 3 and {src for src, _ in forks} == {parent.state_slot}
    assert len({dst for _, dst in forks} | {parent.state_slot}) == 4
    out = _drain(s)
    assert all(out[("n4", i)][1] is FinishCause.LENGTH for i in range(4))


def test_a_failed_step_returns_its_claimed_snapshots() -> None:
    s = _hybrid(chunk=8, interval=8)
    s.add(_request("a", 20))
    plan, events = _step(s, fail=True)
    assert plan.memory.captures and events[0].finish is FinishCause.ERROR
    assert s.states.snapshots_held == 0 and s.states.live_in_use == 0
    s.states.check(0)


def test_slots_never_leak_under_preemption_aborts_forks_and_failures() -> None:
    rng = random.Random(5)
    for trial in range(6):
        s = _hybrid(pages=14, chunk=rng.choice([4, 8, 16]), concurrency=5, snapshots=3, interval=rng.choice([0, 4, 8]))
        for i in range(12):
            s.add(_request(f"r{i}", rng.randint(1, 20), n=rng.choice([1, 1, 2, 4]), max_tokens=rng.randint(1, 12)))
        out: dict = {}
        for step in range(10_000):
            if not s.has_work:
                break
            if step % 7 == 3 and s.running:
                victim = rng.choice(s.running).request.request_id
                _collect(out, s.abort({(victim, None)}))
                s.check_invariants()
            plan = s.schedule()
            events = list(plan.finished)
            if trial % 2 and step % 11 == 5:
                events += s.fail(plan, "boom")
            else:
                tokens = {id(q): (SampledToken(7, None),) for c in plan.chunks if c.wants_logits for q in c.choices}
                events += s.update_from_output(plan, ModelOutput(tokens))
            # Every chunk of a sequence not starting at 0 resumes a slot it holds; restores target live slots.
            assert all(dst < s.states.num_live and src >= s.states.num_live for src, dst in plan.memory.state_before)
            s.check_invariants()
            _collect(out, events)
        assert not s.has_work and s.states.live_in_use == 0
        s.states.check(0)
        assert all(finish is not None for _, finish in out.values())


def test_a_decoding_sequence_follows_its_endpoint_and_registers_it_at_finish() -> None:
    s = _hybrid(chunk=64, interval=0)
    s.add(_request("a", 6, max_tokens=7))  # positions 0..5 prompt; decoding crosses the boundaries at 8 and 12
    _step(s)  # prefill to 4 (the prompt's last page boundary)
    endpoint_copies = []
    while s.has_work:
        plan = s.schedule()
        endpoint_copies += [
            (c.start + c.num_tokens, dst)
            for c in plan.chunks
            for src, dst in plan.memory.state_after
            if src == c.seq.state_slot and c.seq.endpoint_slot == dst
        ]
        tokens = {id(q): (SampledToken(7, None),) for c in plan.chunks if c.wants_logits for q in c.choices}
        s.update_from_output(plan, ModelOutput(tokens))
        s.check_invariants()
    assert [end for end, _ in endpoint_copies] == [8, 12] and len({dst for _, dst in endpoint_copies}) == 1
    assert s.stats.checkpoint_captures == {"message": 1, "endpoint": 1}
    # the next turn (the whole answer, then more) resumes from the endpoint at 12
    turn = EngineRequest("b", tuple(range(1, 7)) + (7,) * 7 + (50, 51, 52), (PARAMS,), max_tokens=1)
    s.add(turn)
    plan, _ = _step(s)
    assert plan.chunks[0].start == 12 and plan.memory.state_before
    _drain(s)


def test_a_failed_step_returns_the_endpoint_slot_it_may_not_have_filled() -> None:
    s = _hybrid(chunk=64, interval=0)
    s.add(_request("a", 7, max_tokens=5))
    while s.has_work:
        plan = s.schedule()
        following = any(c.seq.endpoint_slot is not None for c in plan.chunks if c.num_tokens == 1)
        if following:
            s.fail(plan, "boom")
        else:
            tokens = {id(q): (SampledToken(7, None),) for c in plan.chunks if c.wants_logits for q in c.choices}
            s.update_from_output(plan, ModelOutput(tokens))
        s.check_invariants()
    assert "endpoint" not in s.stats.checkpoint_captures and s.states.snapshots_held == 1  # only the prompt's
    s.states.check(0)


def test_spare_slots_are_lent_only_beyond_what_sequences_are_owed() -> None:
    pool = StatePool(2, 0, num_spare=1)
    first = pool.allocate()
    lent = pool.borrow()  # one spare: lent while the second sequence's slot stays free for it
    assert lent is not None and pool.borrow() is None and not pool.can_borrow
    second = pool.allocate()  # the sequence allowed by max_concurrency still gets its slot
    pool.check(2)
    pool.give_back(first)  # a rewind: the borrowed slot became the sequence's live one
    pool.release(lent)
    pool.release(second)
    pool.check(0)
    assert pool.can_borrow and pool.num_borrowed == 0
