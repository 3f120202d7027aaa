"""The engine on real cores: batching invariance, seeded sampling, n, aborts, page hygiene."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams

SAMPLED = SamplingParams(0.9, 0.95, 50, 0.0, 1.0, 0.0, 0.0, 1234)
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4, 5,",
    "Water boils at",
    "My favourite colour is blue because",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hi",
]


def _requests(core: Core, max_tokens: int, params: SamplingParams = GREEDY, prefix: str = "") -> list[EngineRequest]:
    tok = core.tokenizer()
    shared = prefix
    return [
        EngineRequest(f"r{i}", tuple(tok.encode(shared + p).ids), (params,), max_tokens, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]


def _engine(core: Core, **overrides) -> LLMEngine:
    return build_engine(core, EngineConfig(**{"num_pages": 256, **overrides}))


def _tokens(outputs) -> dict[str, list[int]]:
    return {rid: choices[0].token_ids for rid, choices in outputs.items()}


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


@pytest.fixture(scope="module")
def smollm2(smollm2_core: Path) -> Core:
    return Core.open(smollm2_core, verify_checksums=False)


INVARIANCE_SETTINGS = ({}, {"enable_prefix_cache": False}, {"prefill_chunk_size": 16})


def _check_batching_invariance(
    core: Core, max_tokens: int, prefix: str = "", settings: tuple[dict, ...] = INVARIANCE_SETTINGS
) -> None:
    requests = _requests(core, max_tokens, prefix=prefix)
    alone = {}
    solo = _engine(core, enable_prefix_cache=False)  # one request at a time, nothing reused
    for request in requests:
        alone.update(_tokens(run_to_completion(solo, [request])))
    for overrides in settings:
        engine = _engine(core, **overrides)
        together = _tokens(run_to_completion(engine, requests))
        assert together == alone, f"batched output differs with {overrides}"
        # A second round reuses cached prefixes (when enabled) and still matches.
        again = run_to_completion(engine, [replace(r, request_id=r.request_id + "b") for r in requests])
        assert {k[:-1]: v for k, v in _tokens(again).items()} == alone
        cached = sum(c[0].num_cached_tokens for c in again.values())
        assert (cached > 0) == overrides.get("enable_prefix_cache", True)


PREAMBLE = "You are a helpful assistant. Answer briefly and precisely, and never make things up. "


def test_batching_invariance_tiny(tiny: Core) -> None:
    _check_batching_invariance(tiny, 24, prefix=PREAMBLE)


def test_batching_invariance_smollm2(smollm2: Core) -> None:
    _check_batching_invariance(smollm2, 12, prefix=PREAMBLE)


def test_seeded_sampling_is_reproducible_and_n_choices_differ(tiny: Core) -> None:
    tok = tiny.tokenizer()
    prompt = tuple(tok.encode("Tell me something").ids)
    params = tuple(replace(SAMPLED, seed=SAMPLED.seed + i) for i in range(3))
    request = EngineRequest("n3", prompt, params, 16, ignore_eos=True)
    first = run_to_completion(_engine(tiny), [request])["n3"]
    second = run_to_completion(_engine(tiny, prefill_chunk_size=4), [request])["n3"]
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({tuple(c.token_ids) for c in first}) == 3  # distinct seeds give distinct samples
    # Choice i equals a single-choice request with seed + i: the seed advances by choice index.
    single = EngineRequest("one", prompt, (params[2],), 16, ignore_eos=True)
    assert run_to_completion(_engine(tiny), [single])["one"][0].token_ids == first[2].token_ids


def test_stops_and_limits(tiny: Core) -> None:
    tok = tiny.tokenizer()
    prompt = tuple(tok.encode("Hello").ids)
    free = run_to_completion(_engine(tiny), [EngineRequest("f", prompt, (GREEDY,), 10, ignore_eos=True)])["f"][0]
    assert free.finish is FinishCause.LENGTH and len(free.token_ids) == 10
    third = free.token_ids[2]
    by_id = EngineRequest("s", prompt, (GREEDY,), 10, ignore_eos=True, stop_token_ids=frozenset({third}))
    out = run_to_completion(_engine(tiny), [by_id])["s"][0]
    assert out.finish is FinishCause.STOP_TOKEN and out.token_ids == free.token_ids[: free.token_ids.index(third) + 1]
    seq = tuple(free.token_ids[3:5])
    by_seq = EngineRequest("q", prompt, (GREEDY,), 10, ignore_eos=True, stop_token_sequences=(seq,))
    out = run_to_completion(_engine(tiny), [by_seq])["q"][0]
    assert out.finish is FinishCause.STOP_TOKEN and out.token_ids[-2:] == list(seq)
    eos = tiny.manifest.tokenizer.eos_token_ids[0]
    forced = EngineRequest("e", prompt, (GREEDY,), 10, stop_token_ids=frozenset())
    engine = _engine(tiny)
    engine.scheduler.config = replace(engine.scheduler.config, eos_ids=frozenset({third}))  # greedy hits an "EOS"
    assert run_to_completion(engine, [forced])["e"][0].finish is FinishCause.EOS
    assert eos in tiny.manifest.tokenizer.eos_token_ids


def test_out_of_pages_finishes_with_length_and_others_continue(tiny: Core) -> None:
    tok = tiny.tokenizer()
    engine = _engine(tiny, num_pages=6)
    long = EngineRequest("long", tuple(tok.encode("a" * 40).ids), (GREEDY,), 200, ignore_eos=True)
    short = EngineRequest("short", tuple(tok.encode("b").ids), (GREEDY,), 5, ignore_eos=True)
    out = run_to_completion(engine, [long, short])
    assert out["short"][0].finish is FinishCause.LENGTH and len(out["short"][0].token_ids) == 5
    assert out["long"][0].finish is FinishCause.LENGTH and 0 < len(out["long"][0].token_ids) < 200
    assert engine.pool.num_free + engine.pool.num_cached == 6


def test_abort_half_of_32_leaks_nothing(tiny: Core) -> None:
    tok = tiny.tokenizer()
    engine = _engine(tiny, num_pages=512, max_concurrency=64)
    requests = [
        EngineRequest(f"a{i}", tuple(tok.encode(f"request number {i}").ids), (GREEDY,), 20, ignore_eos=True)
        for i in range(32)
    ]
    outputs = {r.request_id: [] for r in requests}
    finishes = {}
    for request in requests:
        engine.add(request)
    for _ in range(3):
        for event in engine.step():
            outputs[event.request_id] += event.token_ids
    for request in requests[::2]:
        engine.abort(request.request_id)
    while engine.has_work:
        for event in engine.step():
            outputs[event.request_id] += event.token_ids
            if event.finish:
                finishes[event.request_id] = event.finish
    assert all(finishes[r.request_id] is FinishCause.ABORT for r in requests[::2])
    solo = _engine(tiny, enable_prefix_cache=False)
    for request in requests[1::2]:
        assert finishes[request.request_id] is FinishCause.LENGTH and len(outputs[request.request_id]) == 20
        alone = run_to_completion(solo, [request])[request.request_id][0].token_ids
        assert outputs[request.request_id] == alone
    assert engine.pool.num_free + engine.pool.num_cached == 512  # every page is free or cached-and-evictable
    assert sum(engine.pool.ref_count) == 0
    assert engine.stats.active == 0 and engine.stats.pending == 0


def test_requests_the_engine_can_never_run_are_refused(tiny: Core) -> None:
    engine = _engine(tiny, num_pages=4)
    too_long = EngineRequest("x", tuple(range(1, 100)), (GREEDY,), 8)
    assert "KV pages" in engine.check(too_long)
    over_context = EngineRequest("y", (1, 2, 3), (GREEDY,), tiny.manifest.limits.max_model_len)
    assert "exceeds the context limit" in engine.check(over_context)


def test_small_decode_steps_run_on_one_thread_with_the_same_tokens(tiny: Core) -> None:
    import torch

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        requests = _requests(tiny, 12)
        expected = _tokens(run_to_completion(_engine(tiny), requests))
        engine = _engine(tiny, serial_decode_rows=2)
        alone = _tokens(run_to_completion(engine, requests[:1]))
        assert torch.get_num_threads() == 1  # its last steps decoded one row
        assert alone == {"r0": expected["r0"]}
        together = _tokens(run_to_completion(engine, [replace(r, request_id=r.request_id + "b") for r in requests]))
        assert torch.get_num_threads() == 2  # eight rows: every thread again
        assert {k[:-1]: v for k, v in together.items()} == expected
    finally:
        torch.set_num_threads(threads)
