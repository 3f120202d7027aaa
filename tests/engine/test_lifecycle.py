"""The engine's lifecycle on a real tiny core: preemption instead of truncation, capacity
limits, requests that can never run, and faults contained to their own step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams

SAMPLED = SamplingParams(0.9, 0.95, 50, 0.0, 1.0, 0.0, 0.0, 77)


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _engine(core: Core, **overrides) -> LLMEngine:
    return build_engine(core, EngineConfig(**{"num_pages": 256, **overrides}))


def _prompt(core: Core, text: str) -> tuple[int, ...]:
    return tuple(core.tokenizer().encode(text).ids)


def _idle(engine: LLMEngine) -> None:
    pool = engine.pool
    assert sum(pool.ref_count) == 0 and pool.num_reserved == 0 and not engine.has_work
    assert pool.num_free + pool.num_cached == pool.num_pages


def test_a_small_pool_preempts_and_every_request_gets_its_whole_answer(tiny: Core) -> None:
    """Six 120-token answers need ~50 pages together; the pool has 14. Nobody is shortened,
    and every answer (greedy and seeded n=2) equals the request run alone."""
    requests = [
        EngineRequest(f"g{i}", _prompt(tiny, f"request {i} says"), (GREEDY,), 120, ignore_eos=True) for i in range(5)
    ]
    params = (SAMPLED, replace(SAMPLED, seed=78))
    requests.append(EngineRequest("s", _prompt(tiny, "sampled twice"), params, 120, ignore_eos=True))
    engine = _engine(tiny, num_pages=14, max_concurrency=16)
    together = run_to_completion(engine, requests)
    assert engine.stats.preemptions > 0
    _idle(engine)
    for request in requests:
        alone = run_to_completion(_engine(tiny, enable_prefix_cache=False), [request])[request.request_id]
        for shared, single in zip(together[request.request_id], alone):
            assert shared.finish is FinishCause.LENGTH and len(shared.token_ids) == 120
            assert shared.token_ids == single.token_ids


def test_a_request_longer_than_the_whole_pool_stops_with_length_when_alone(tiny: Core) -> None:
    engine = _engine(tiny, num_pages=4)  # 64 token slots
    request = EngineRequest("big", _prompt(tiny, "hello"), (GREEDY,), 500, ignore_eos=True)
    out = run_to_completion(engine, [request])["big"][0]
    assert out.finish is FinishCause.LENGTH and len(out.token_ids) == 64 - len(request.prompt_ids) + 1
    _idle(engine)


def test_requests_that_can_never_run_are_refused_with_the_limit_named(tiny: Core) -> None:
    engine = _engine(tiny, num_pages=4, max_concurrency=8)
    many = EngineRequest("n", (1, 2, 3), (GREEDY,) * 9, 4)
    assert "max_concurrency of 8" in engine.check(many)
    wide = EngineRequest("w", tuple(range(1, 40)), (GREEDY,) * 3, 4)  # 2 full pages + 3 private pages > 4
    assert "KV pages" in engine.check(wide) and "kv_pages" in engine.check(wide)
    assert engine.check(EngineRequest("ok", tuple(range(1, 40)), (GREEDY,) * 2, 4)) is None


def test_a_failed_step_fails_only_its_requests_and_the_engine_keeps_serving(tiny: Core) -> None:
    engine = _engine(tiny, max_concurrency=1)  # one runs; the others wait outside the failing step
    run = engine.executor.run
    calls = {"n": 0}

    def fault_once(chunks, page_copies=(), *state_copies, **options):  # options: fed= (async output handling)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return run(chunks, page_copies, *state_copies, **options)

    engine.executor.run = fault_once
    requests = [EngineRequest(name, _prompt(tiny, name), (GREEDY,), 6, ignore_eos=True) for name in ("a", "b", "c")]
    out = run_to_completion(engine, requests)
    assert out["a"][0].finish is FinishCause.ERROR and "injected device fault" in out["a"][0].error
    assert [out[n][0].finish for n in ("b", "c")] == [FinishCause.LENGTH, FinishCause.LENGTH]
    assert all(len(out[n][0].token_ids) == 6 for n in ("b", "c"))
    assert engine.stats.failed == 1 and engine.stats.completed == 2
    _idle(engine)
