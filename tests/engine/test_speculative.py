"""Speculative decoding from the history drafter: verified drafts never change what is
generated (greedy or seeded sampling, stops, n, penalties, preemption), logprobs stay the
target model's, sampled tokens follow the target distribution, and the counters add up."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helios.core import Core
from helios.engine import EngineConfig, build_engine
from helios.engine.executor import StepResult
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams
from helios.engine.sequence import Chunk, SchedulerOutput, Sequence
from helios.engine.speculation.drafter import DraftPicker, NgramIndex, PayoffGate, SharedHistory, SpeculationConfig

SAMPLED = SamplingParams(0.7, 0.95, -1, 0.0, 1.0, 0.0, 0.0, 77)
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 5
FIXED = SpeculationConfig(mode="fixed", max_drafts=4)


@pytest.fixture(scope="module")
def core(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _prompts(core: Core) -> list[tuple[int, ...]]:
    ids = tuple(core.tokenizer().encode(CODE).ids)
    other = tuple(core.tokenizer().encode("the cat sat on the mat and the cat sat on the hat, " * 4).ids)
    return [ids, ids[:-9], other, other[:-5], (5, 6, 7, 5, 6, 7, 5, 6)]


def _run(core: Core, requests: list[EngineRequest], speculation: SpeculationConfig | None, **config):
    engine = build_engine(
        core,
        EngineConfig(
            num_pages=config.pop("num_pages", 256), speculation=speculation or SpeculationConfig(mode="off"), **config
        ),
    )
    out = run_to_completion(engine, requests)
    engine.scheduler.check_invariants()
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages  # nothing held after the end
    return out, engine


def _requests(core: Core, params: SamplingParams, max_tokens: int = 40, **fields) -> list[EngineRequest]:
    return [
        EngineRequest(f"r{i}", prompt, (params,), max_tokens, ignore_eos=True, num_top_logprobs=3, **fields)
        for i, prompt in enumerate(_prompts(core))
    ]


def _same(a, b, tolerance: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            assert x.token_ids == y.token_ids, key
            assert x.finish == y.finish
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert abs(p.logprob - q.logprob) <= tolerance
                assert [t for t, _ in p.alternatives] == [t for t, _ in q.alternatives]
                assert (
                    max((abs(u - v) for (_, u), (_, v) in zip(p.alternatives, q.alternatives)), default=0) <= tolerance
                )


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_greedy_output_and_logprobs_are_unchanged(core: Core, mode: str) -> None:
    plain, _ = _run(core, _requests(core, GREEDY), None)
    spec, engine = _run(core, _requests(core, GREEDY), SpeculationConfig(mode=mode, max_drafts=4, row_budget=64))
    _same(plain, spec)
    stats = engine.stats
    assert stats.draft_rounds > 0 and 0 < stats.accepted_drafts <= stats.verification_drafts
    assert sum(stats.rounds_by_depth.values()) == stats.verification_rounds
    assert stats.steps < 41 * 5  # drafts were accepted: fewer steps than one per token


def test_seeded_sampling_draws_the_same_tokens(core: Core) -> None:
    cold = replace(SAMPLED, temperature=0.2)  # a sharp distribution, so drafts are often accepted
    plain, _ = _run(core, _requests(core, cold), None)
    spec, engine = _run(core, _requests(core, cold), FIXED)
    _same(plain, spec)
    assert engine.stats.accepted_drafts > 0
    hot, _ = _run(core, _requests(core, SAMPLED), None)
    assert {k: v[0].token_ids for k, v in hot.items()} == {
        k: v[0].token_ids for k, v in _run(core, _requests(core, SAMPLED), FIXED)[0].items()
    }


def test_stops_max_tokens_and_choices(core: Core) -> None:
    prompts = _prompts(core)
    plain_probe, _ = _run(core, [EngineRequest("p", prompts[0], (GREEDY,), 30, ignore_eos=True)], None)
    generated = plain_probe["p"][0].token_ids
    stop = tuple(generated[12:14])  # a token stop sequence that verification will accept inside a draft
    requests = [
        EngineRequest(
            "stop", prompts[0], (GREEDY,), 30, ignore_eos=True, num_top_logprobs=0, stop_token_sequences=(stop,)
        ),
        EngineRequest("eos", prompts[0], (GREEDY,), 30, num_top_logprobs=0, stop_token_ids=(generated[9],)),
        EngineRequest("short", prompts[1], (GREEDY,), 3, ignore_eos=True, num_top_logprobs=0),
        EngineRequest(
            "n",
            prompts[2],
            (GREEDY, replace(SAMPLED, seed=5), replace(SAMPLED, seed=6)),
            20,
            ignore_eos=True,
            num_top_logprobs=0,
        ),
    ]
    plain, _ = _run(core, requests, None)
    spec, _ = _run(core, requests, FIXED)
    _same(plain, spec)
    assert spec["stop"][0].finish is FinishCause.STOP_TOKEN and len(spec["short"][0].token_ids) == 3
    assert len(spec["n"]) == 3


def test_penalties_see_accepted_drafts(core: Core) -> None:
    penalized = replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    plain, _ = _run(core, _requests(core, penalized), None)
    spec, _ = _run(core, _requests(core, penalized), FIXED)
    _same(plain, spec)


def test_preemption_and_prefix_reuse_keep_outputs(core: Core) -> None:
    requests = _requests(core, GREEDY, max_tokens=48)
    plain, _ = _run(core, requests, None)
    again = requests + [replace(r, request_id=r.request_id + "b") for r in requests]
    spec, engine = _run(core, again, FIXED, num_pages=32, prefill_chunk_size=16)  # each fits alone, not all at once
    assert engine.stats.preemptions > 0
    for key, value in plain.items():
        assert spec[key][0].token_ids == value[0].token_ids == spec[key + "b"][0].token_ids


def test_speculation_backs_off_at_the_row_budget(core: Core) -> None:
    busy = SpeculationConfig(mode="adaptive", max_drafts=4, row_budget=4)  # five decode rows: past the budget
    spec, engine = _run(core, _requests(core, GREEDY, max_tokens=12), busy)
    assert engine.stats.verification_drafts == 0 and engine.stats.verification_rounds > 0
    plain, _ = _run(core, _requests(core, GREEDY, max_tokens=12), None)
    _same(plain, spec)


def test_prompt_logprobs_and_speculation(core: Core) -> None:
    prompt = _prompts(core)[0]
    request = EngineRequest("s", prompt, (GREEDY,), 20, ignore_eos=True, num_top_logprobs=1, prompt_logprobs=2)
    plain, _ = _run(core, [request], None)
    spec, engine = _run(core, [request], FIXED)
    _same(plain, spec)
    assert len(spec["s"][0].prompt_logprobs) == len(prompt) and engine.stats.accepted_drafts > 0


def test_verified_draft_follows_the_target_distribution(core: Core) -> None:
    """Chi-square: the token verification commits at a drafted position, over many seeds, is
    distributed as the target's softmax there (here a fixed random row of logits), and the
    draft is accepted about as often as the target gives it."""
    engine = build_engine(core, EngineConfig(num_pages=8))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, engine.vocab_size, generator=generator) * 3  # row 0: the verified position
    target = torch.softmax(logits[0], dim=-1)
    draft = int(target.argsort()[-3])  # plausible, not the likeliest
    engine.executor = _FixedLogits(logits)
    params = SamplingParams(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 0)
    trials = 3000
    counts: Counter[int] = Counter()
    for seed in range(trials):
        request = EngineRequest(f"s{seed}", (5, 6, 7), (replace(params, seed=seed),), 8, ignore_eos=True)
        seq = Sequence(request, 0, [5, 6, 7, 9], 3, 0, pages=[0], num_computed=3)
        chunk = Chunk(seq, 3, 1, wants_logits=True, scored=False, choices=(seq,), draft_ids=(draft,))
        committed = engine._run(SchedulerOutput((chunk,))).tokens[id(seq)]
        assert len(committed) == (2 if committed[0].token_id == draft else 1)  # accepted: the bonus follows
        counts[committed[0].token_id] += 1
    top = target.argsort(descending=True)[:8].tolist()
    expected = [float(target[t]) * trials for t in top] + [(1 - float(target[top].sum())) * trials]
    observed = [counts[t] for t in top] + [trials - sum(counts[t] for t in top)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < 26.1, (observed, expected)  # p = 0.001 at 8 degrees of freedom
    assert abs(counts[draft] / trials - float(target[draft])) < 4 * math.sqrt(float(target[draft]) / trials)


class _FixedLogits:
    """An executor whose every step returns the same rows of logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def run(self, chunks, memory=None) -> StepResult:
        return StepResult(tuple(chunks), self.logits, self.logits.logsumexp(dim=-1), None, None, None, {})


def test_ngram_index_finds_the_latest_earlier_occurrence() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert index.follow(tokens, 3) == (8, 7, 1)  # the later "1 2 3" (followed by 8), not the first
    tokens += [8]
    assert index.follow(tokens, 2) == (7, 1)
    assert NgramIndex().follow([4, 5, 6], 3) == ()


def test_shared_history_is_partitioned_by_cache_identity() -> None:
    shared = SharedHistory(1000)
    shared.add(b"tenant-a", [10, 11, 12, 13, 14, 15])
    assert shared.follow(b"tenant-a", [99, 11, 12], 2) == (13, 14)
    assert shared.follow(b"tenant-b", [99, 11, 12], 2) == ()


def test_the_payoff_gate_keeps_drafts_only_where_they_win() -> None:
    """Per bucket of decoding sequences: drafts are tried first, then plain steps; the faster arm
    (committed tokens per sequence per second) wins, and the other one still gets one step in
    EXPLORE_EVERY, so a change in traffic turns the answer back."""
    gate = PayoffGate()
    assert gate.allow(16)  # nothing measured: try drafts
    gate.observe(16, True, committed=20, seconds=0.045)  # 16 sequences, 4 drafts accepted, dear step
    assert not gate.allow(16) and not gate.allow(9)  # the same bucket (9-16): now measure plain steps
    gate.observe(16, False, committed=16, seconds=0.030)
    answers = []
    for _ in range(PayoffGate.EXPLORE_EVERY * 2):
        answers.append(gate.allow(16))
        gate.observe(16, answers[-1], committed=20 if answers[-1] else 16, seconds=0.045 if answers[-1] else 0.030)
    assert answers.count(True) == 2  # plain wins; drafts explored once per EXPLORE_EVERY steps
    assert gate.allow(1)  # another bucket is measured on its own
    for _ in range(8):  # the traffic turns repetitive: every draft accepted, drafts now win in 9-16
        gate.observe(16, True, committed=64, seconds=0.045)
    assert gate.allow(16)


def test_the_payoff_gate_weighs_steps_by_their_time() -> None:
    """An arm's rate is its tokens over its time: drafted steps alternating 3 tokens in 20 ms and 1
    in 5 ms deliver 160 tokens/s, behind plain steps' 1 in 6 ms (167/s), though the average of
    their per-step rates (150 and 200) is ahead."""
    gate = PayoffGate()
    gate.observe(1, False, committed=1, seconds=0.006)
    for step in range(40):
        gate.observe(1, True, committed=3 if step % 2 else 1, seconds=0.020 if step % 2 else 0.005)
    assert not gate.allow(1)


def test_the_gate_backs_speculation_off_where_drafts_lose(core: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive mode where the gate measured verification steps committing less per second than
    plain ones: steps carry no drafts, outputs are unchanged, and every decode-only step (not a
    prefill) is reported to the gate with its row count and what it committed."""
    adaptive = SpeculationConfig(mode="adaptive", max_drafts=4, row_budget=64)
    engine = build_engine(core, EngineConfig(num_pages=256, speculation=adaptive))
    gate = engine.scheduler.drafter.gate
    gate.observe(5, True, committed=6, seconds=1.0)  # drafted steps: 1.2 tokens per sequence per second
    gate.observe(5, False, committed=5, seconds=0.5)  # plain: 2
    seen: list[tuple[int, bool, int]] = []
    monkeypatch.setattr(
        gate, "observe", lambda decoding, drafted, committed, seconds: seen.append((decoding, drafted, committed))
    )
    requests = _requests(core, GREEDY, max_tokens=6)
    out = run_to_completion(engine, requests)
    assert engine.stats.verification_drafts == 0
    plain, _ = _run(core, requests, None)
    _same(plain, out)
    assert seen and seen[0][0] == len(requests)
    assert all(not drafted and committed == decoding for decoding, drafted, committed in seen)


class _Grammar:
    """A stand-in constraint: allows the tokens of `allowed` in order, then nothing."""

    def __init__(self, allowed: list[set[int]]) -> None:
        self.allowed = allowed

    def fork(self) -> _Grammar:
        return _Grammar(list(self.allowed))

    def advance(self, token: int) -> bool:
        if not self.allowed or token not in self.allowed[0]:
            return False
        self.allowed.pop(0)
        return True


def test_the_draft_picker_takes_the_likeliest_token_the_grammar_allows() -> None:
    vocab = 6

    def masks(rows: list) -> torch.Tensor:
        allowed = torch.ones(len(rows), vocab, dtype=torch.bool)
        for index, row in enumerate(rows):
            if isinstance(row.constraint, _Grammar):
                allowed[index] = torch.tensor([t in (row.constraint.allowed or [set()])[0] for t in range(vocab)])
        return allowed

    picker = DraftPicker(masks)
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0.0, 0.0]] * 3)  # the plain argmax is token 1
    seq = SimpleNamespace(request=None)
    grammar = _Grammar([{2, 3}, {4}])
    free, masked, done = picker.pick(logits, [(seq, None), (seq, grammar), (seq, _Grammar([]))])
    assert free == (1, None)  # no constraint: the plain argmax
    assert masked is not None and masked[0] == 3 and masked[1].allowed == [{4}]  # best allowed, state advanced
    assert done is None  # the grammar allows nothing more: the chain stops
    assert grammar.allowed == [{2, 3}, {4}]  # the caller's state is forked, never advanced
    assert DraftPicker(None).pick(logits[:1], [(seq, grammar)]) == [None]  # unmasked, the argmax is refused
