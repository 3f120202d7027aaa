"""Recurrent-state slots through the engine on real tiny hybrid cores (Mamba-2, gated DeltaNet
and KDA families): preemption, n = 4 forks and aborts leave no slot behind, every answer
equals the request run alone, and a shared prefix resumes from a state snapshot exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support import TinyCores

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.offline import ChoiceOutput, collect, run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams
from ignition.models import FAMILIES
from tests.engine.speculation_checks import wrong_every_third

pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)

SAMPLED = SamplingParams(0.9, 0.95, 50, 0.0, 1.0, 0.0, 0.0, 17)
HYBRIDS = [
    (family, recipe)
    for family, recipe in (("nemotron_h", "nemotron_h"), ("qwen3_next", "qwen38"), ("glm5_next", "glm53"))
    if family in FAMILIES
]


@pytest.fixture(scope="module", params=HYBRIDS, ids=[f for f, _ in HYBRIDS])
def hybrid(request, tiny_cores: TinyCores) -> Core:
    """The family's tiny core (its test checkpoint, seed 4, the recipe's defaults): the one the
    reasoning-budget and recipe round-trip tests serve."""
    family, recipe = request.param
    core = Core.open(tiny_cores(family, recipe, 4)[1])
    assert core.manifest.kv.state, f"{family} cores carry recurrent state"
    return core


def _prompt(core: Core, text: str) -> tuple[int, ...]:
    return tuple(core.tokenizer().encode(text).ids)


def _engine(core: Core, **overrides) -> LLMEngine:
    return build_engine(core, EngineConfig(**{"num_pages": 64, "prefill_chunk_size": 16, **overrides}))


def _idle(engine: LLMEngine) -> None:
    engine.scheduler.check_invariants()
    assert engine.states is not None and engine.states.live_in_use == 0
    engine.states.check(0)


def test_preemption_forks_and_aborts_leave_no_state_slot_and_answers_equal_solo_runs(hybrid: Core) -> None:
    requests = [
        EngineRequest(
            f"g{i}", _prompt(hybrid, f"request number {i} says hello to the world"), (GREEDY,), 40, ignore_eos=True
        )
        for i in range(4)
    ]
    requests.append(
        EngineRequest(
            "n4",
            _prompt(hybrid, "four choices from one prompt"),
            tuple(replace(SAMPLED, seed=s) for s in range(4)),
            40,
            ignore_eos=True,
        )
    )
    doomed = EngineRequest("doomed", _prompt(hybrid, "this one is aborted half way"), (GREEDY,), 40, ignore_eos=True)
    engine = _engine(hybrid, num_pages=12, max_concurrency=12)
    outputs = {r.request_id: [ChoiceOutput() for _ in range(r.n)] for r in [*requests, doomed]}
    for request in [*requests, doomed]:
        engine.add(request)
    steps = 0
    while engine.has_work:
        for event in engine.step():
            collect(outputs, event)
        engine.scheduler.check_invariants()
        steps += 1
        if steps == 6:
            engine.abort("doomed")
    assert engine.stats.preemptions > 0
    assert outputs["doomed"][0].finish is FinishCause.ABORT
    _idle(engine)
    for request in requests:
        alone = run_to_completion(_engine(hybrid, enable_prefix_cache=False), [request])[request.request_id]
        for shared, single in zip(outputs[request.request_id], alone, strict=True):
            assert shared.finish is FinishCause.LENGTH and shared.token_ids == single.token_ids


def test_a_shared_prefix_resumes_from_its_snapshot_with_the_uncached_output(hybrid: Core) -> None:
    prefix = _prompt(hybrid, "The quick brown fox jumps over the lazy dog. " * 6)
    first = EngineRequest("first", prefix + _prompt(hybrid, " Then the end."), (GREEDY,), 12, ignore_eos=True)
    second = EngineRequest("second", prefix + _prompt(hybrid, " And so on."), (GREEDY,), 12, ignore_eos=True)
    uncached = run_to_completion(_engine(hybrid, enable_prefix_cache=False), [second])["second"][0]
    engine = _engine(hybrid)
    run_to_completion(engine, [first])
    assert engine.states.snapshots_held > 0
    cached = run_to_completion(engine, [second])["second"][0]
    assert cached.num_cached_tokens > 0 and cached.num_cached_tokens % hybrid.manifest.limits.page_tokens == 0
    assert cached.token_ids == uncached.token_ids
    _idle(engine)
    # without snapshots the same pages are recomputed, never resumed from a stale slot
    bare = _engine(hybrid, state_snapshots=0)
    run_to_completion(bare, [first])
    again = run_to_completion(bare, [second])["second"][0]
    assert again.num_cached_tokens == 0 and again.token_ids == uncached.token_ids


def test_the_next_turn_resumes_after_the_previous_answer_from_its_endpoint(hybrid: Core) -> None:
    first = EngineRequest(
        "t1", _prompt(hybrid, "Tell me a story about a fox and a dog."), (GREEDY,), 40, ignore_eos=True
    )
    engine = _engine(hybrid)
    answer = run_to_completion(engine, [first])["t1"][0].token_ids
    history = first.prompt_ids + tuple(answer)
    second = EngineRequest("t2", history + _prompt(hybrid, " Now a shorter one."), (GREEDY,), 8, ignore_eos=True)
    resumed = run_to_completion(engine, [second])["t2"][0]
    size = hybrid.manifest.limits.page_tokens
    # the answer's full pages are reused too, not only the first prompt's
    assert resumed.num_cached_tokens == (len(history) - 1) // size * size > len(first.prompt_ids)
    assert engine.stats.checkpoint_captures.get("endpoint") == 1
    uncached = run_to_completion(_engine(hybrid, enable_prefix_cache=False), [second])["t2"][0]
    assert resumed.token_ids == uncached.token_ids
    _idle(engine)


def test_an_anchor_capture_fills_a_guard_and_the_gauge_follows(hybrid: Core) -> None:
    prompt = _prompt(hybrid, "Tell me a story about a fox and a dog, then another about a cat.")
    size = hybrid.manifest.limits.page_tokens
    anchor = size * (len(prompt) // size // 2)
    assert anchor > 0
    engine = _engine(hybrid, state_snapshots=8, anchor_guards=2, checkpoint_work_fraction=1.0)
    assert engine.states.unused_guards == 2
    warm = EngineRequest("warm", _prompt(hybrid, "Hi there, a warm-up turn of some length."), (GREEDY,), 4)
    run_to_completion(engine, [warm])  # step costs of two sizes measured: hints can be priced
    request = EngineRequest("a", prompt, (GREEDY,), 2, checkpoint_hints=((anchor, "anchor"),))
    run_to_completion(engine, [request])
    assert engine.stats.checkpoint_captures.get("anchor") == 1
    assert engine.states.unused_guards == 1 and engine.stats.checkpoint_anchor_reservations == 1
    _idle(engine)


def test_speculation_rewinds_the_state_after_rejections_and_changes_no_output(hybrid: Core) -> None:
    """Drafts on a hybrid core: a rejected draft's state is rolled back (the borrowed copy becomes
    the live slot), so tokens and logprobs equal plain decoding. The drafts are the plain run's own
    continuation with every third round's middle draft wrong, so every family sees accepted and
    rejected drafts; forks, preemption and a single spare slot (others then decode plainly) included."""
    from helios.engine.speculation.drafter import SpeculationConfig

    text = "one two three four one two three four "
    requests = [
        EngineRequest(f"s{i}", _prompt(hybrid, text * (i + 1)), (GREEDY,), 40, ignore_eos=True, num_top_logprobs=2)
        for i in range(3)
    ]
    requests.append(
        EngineRequest(
            "n2", _prompt(hybrid, text), tuple(replace(SAMPLED, seed=s) for s in range(2)), 32, ignore_eos=True
        )
    )
    plain = run_to_completion(_engine(hybrid, enable_prefix_cache=False), requests)
    oracle = wrong_every_third(plain, requests)
    for spare, pages in ((None, 64), (1, 14)):  # roomy; then one spare slot and a pool that preempts
        engine = _engine(hybrid, num_pages=pages, speculation=SpeculationConfig(mode="fixed", max_drafts=4))
        engine.scheduler.drafter.propose = oracle
        if spare is not None:  # keep one spare live slot of the engine's eight
            states = engine.states
            states._free_live = type(states._free_live)(sorted(states._free_live)[: states.num_sequences + spare])
            states.num_live = states.num_sequences + spare
        outputs = {r.request_id: [ChoiceOutput() for _ in range(r.n)] for r in requests}
        for request in requests:
            engine.add(request)
        while engine.has_work:
            for event in engine.step():
                collect(outputs, event)
            engine.scheduler.check_invariants()
        stats = engine.stats
        assert stats.verification_drafts > stats.accepted_drafts > 0, "drafts were accepted and rejected"
        assert stats.state_rewinds > 0
        if spare is not None:
            assert stats.preemptions > 0
        for rid, choices in plain.items():
            for ours, theirs in zip(outputs[rid], choices, strict=True):
                assert ours.token_ids == theirs.token_ids, rid
                for a, b in zip(ours.logprobs or (), theirs.logprobs or (), strict=True):
                    assert abs(a.logprob - b.logprob) <= 1e-4
        _idle(engine)
