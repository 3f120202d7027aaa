"""Async output handling (helios/engine/overlap.py) forced on gives exactly the synchronous outputs:
tokens, logprobs and finishes under stops, max_tokens, a pool too small for the request,
cancellation and a failed step, with every page back in the pool, and the steps it may overlap
did overlap."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.offline import ChoiceOutput, collect, run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams

SAMPLED = SamplingParams(0.9, 0.95, 50, 0.0, 1.0, 0.0, 0.0, 1234)


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _engine(core: Core, overlapped: bool, **overrides) -> LLMEngine:
    engine = build_engine(core, EngineConfig(**{"num_pages": 128, "async_output": overlapped, **overrides}))
    assert engine.async_output is overlapped
    return engine


def _fed_steps(engine: LLMEngine) -> list[bool]:
    """Record, per executor run, whether the previous step's device ids fed it (an overlapped step)."""
    fed: list[bool] = []
    run = engine.executor.run

    def recorded(chunks, memory, **kwargs):
        fed.append(kwargs.get("fed") is not None)
        return run(chunks, memory, **kwargs)

    engine.executor.run = recorded  # type: ignore[method-assign]
    return fed


def _prompt(core: Core, text: str) -> tuple[int, ...]:
    return tuple(core.tokenizer().encode(text).ids)


def _free_run(core: Core, prompt: tuple[int, ...], count: int) -> list[int]:
    request = EngineRequest("free", prompt, (GREEDY,), count, ignore_eos=True)
    return run_to_completion(_engine(core, False), [request])["free"][0].token_ids


def _assert_clean(engine: LLMEngine) -> None:
    engine.scheduler.check_invariants()
    assert not engine.has_work
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages
    assert sum(engine.pool.ref_count) == 0


def _stop_requests(core: Core) -> list[EngineRequest]:
    hello = _prompt(core, "Hello")
    free = _free_run(core, hello, 12)
    sampled_pair = (SAMPLED, replace(SAMPLED, seed=99))
    return [
        EngineRequest("free", hello, (GREEDY,), 12, ignore_eos=True, num_top_logprobs=2),
        EngineRequest("one", _prompt(core, "Water boils at"), (GREEDY,), 1, ignore_eos=True),
        EngineRequest("two", _prompt(core, "1, 2, 3,"), (GREEDY,), 2, ignore_eos=True, num_top_logprobs=1),
        EngineRequest("stop-id", hello, (GREEDY,), 12, ignore_eos=True, stop_token_ids=frozenset({free[3]})),
        EngineRequest("stop-seq", hello, (GREEDY,), 12, ignore_eos=True, stop_token_sequences=(tuple(free[4:6]),)),
        EngineRequest("eos", _prompt(core, "Hi"), (GREEDY,), 12),
        EngineRequest("seeded", _prompt(core, "Once upon a time"), sampled_pair, 9, ignore_eos=True),
        # Penalties keep the synchronous path for the steps they are in; the others still overlap.
        EngineRequest("penalized", _prompt(core, "The quick brown fox"), (replace(GREEDY, repetition_penalty=1.3),), 7),
    ]


def _with_eos(engine: LLMEngine, token: int) -> LLMEngine:
    engine.scheduler.config = replace(engine.scheduler.config, eos_ids=frozenset({token}))  # greedy hits an "EOS"
    return engine


def test_stops_and_limits_give_the_synchronous_outputs(tiny: Core) -> None:
    requests = _stop_requests(tiny)
    eos = _free_run(tiny, requests[5].prompt_ids, 6)[4]
    expected = run_to_completion(_with_eos(_engine(tiny, False), eos), requests)
    engine = _with_eos(_engine(tiny, True), eos)
    fed = _fed_steps(engine)
    got = run_to_completion(engine, requests)
    assert got == expected
    assert expected["stop-id"][0].finish is FinishCause.STOP_TOKEN
    assert expected["stop-seq"][0].finish is FinishCause.STOP_TOKEN
    assert expected["eos"][0].finish is FinishCause.EOS
    assert [len(expected[r][0].token_ids) for r in ("free", "one", "two")] == [12, 1, 2]
    assert any(fed) and not all(fed)  # overlapped where it could, synchronous around the penalized request
    _assert_clean(engine)


def test_a_request_that_outgrows_the_pool_keeps_its_last_token(tiny: Core) -> None:
    request = EngineRequest("big", _prompt(tiny, "hello"), (GREEDY,), 500, ignore_eos=True)
    expected = run_to_completion(_engine(tiny, False, num_pages=4), [request])
    engine = _engine(tiny, True, num_pages=4)  # 64 token slots
    assert run_to_completion(engine, [request]) == expected
    assert expected["big"][0].finish is FinishCause.LENGTH
    assert len(expected["big"][0].token_ids) == 64 - len(request.prompt_ids) + 1
    _assert_clean(engine)


def test_overlap_stays_on_for_unpenalized_decoding(tiny: Core) -> None:
    requests = [
        EngineRequest(f"r{i}", _prompt(tiny, f"request number {i}"), (GREEDY,), 6, ignore_eos=True) for i in range(4)
    ]
    engine = _engine(tiny, True)
    fed = _fed_steps(engine)
    got = run_to_completion(engine, requests)
    assert got == run_to_completion(_engine(tiny, False), requests)
    assert fed[0] is False and all(fed[1:])  # every step after the first ran on the previous step's ids
    _assert_clean(engine)


def _drive(engine: LLMEngine, requests: list[EngineRequest], aborts: dict[int, list[tuple[str, int | None]]]):
    """Step to completion, aborting (request, choice) pairs before the step numbered in `aborts`."""
    outputs = {r.request_id: [ChoiceOutput() for _ in range(r.n)] for r in requests}
    for request in requests:
        engine.add(request)
    step = 0
    while engine.has_work:
        for request_id, choice in aborts.get(step, []):
            engine.abort(request_id, choice)
        for event in engine.step():
            collect(outputs, event)
        step += 1
    return outputs


def test_cancellation_gives_the_synchronous_outputs(tiny: Core) -> None:
    requests = [
        EngineRequest(f"a{i}", _prompt(tiny, f"request number {i}"), (GREEDY,), 10, ignore_eos=True) for i in range(6)
    ]
    requests.append(
        EngineRequest("pair", _prompt(tiny, "Once"), (SAMPLED, replace(SAMPLED, seed=7)), 10, ignore_eos=True)
    )
    aborts = {1: [("a0", None)], 3: [("a2", None), ("pair", 1)], 5: [("a4", None)]}
    expected = _drive(_engine(tiny, False), requests, aborts)
    engine = _engine(tiny, True)
    got = _drive(engine, requests, aborts)
    assert got == expected
    assert [expected[f"a{i}"][0].finish for i in (0, 2, 4)] == [FinishCause.ABORT] * 3
    assert expected["pair"][1].finish is FinishCause.ABORT and 0 < len(expected["pair"][1].token_ids) < 10
    _assert_clean(engine)


def test_a_failed_step_gives_the_synchronous_outputs(tiny: Core) -> None:
    requests = [
        EngineRequest(f"f{i}", _prompt(tiny, f"request number {i}"), (GREEDY,), 8, ignore_eos=True) for i in range(3)
    ]

    def failing(engine: LLMEngine, at: int) -> LLMEngine:
        run, calls = engine.executor.run, [0]

        def broken(chunks, memory, **kwargs):
            calls[0] += 1
            if calls[0] == at:
                raise RuntimeError("device lost")
            return run(chunks, memory, **kwargs)

        engine.executor.run = broken  # type: ignore[method-assign]
        return engine

    expected = run_to_completion(failing(_engine(tiny, False), 4), requests)
    engine = failing(_engine(tiny, True), 4)
    assert run_to_completion(engine, requests) == expected
    assert all(
        c.finish is FinishCause.ERROR and len(c.token_ids) == 3 for choices in expected.values() for c in choices
    )
    _assert_clean(engine)
