"""Learned drafts from a core's MTP programs (helios.engine.speculation.mtp) on three tiny cores with one MTP
layer each: MiMo-V2 (sliding attention with an 8-key window), DeepSeek-V3's (kimi_k3: MLA over a
latent cache, routed MoE) and Qwen3-Next (a hybrid: gated DeltaNet state rewound after rejected
drafts; gated attention and routed MoE in the MTP layer), 16-token pages. Output and logprobs are those of plain decoding with
speculation off, history drafts only and MTP drafts; every MTP proposal is what the family's MTP
layer computes over the committed tokens (its KV stays consistent through rejected rounds, forks
and preemption); nothing is left behind after cancellation or preemption; /metrics names it."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from helios.core import Core
from helios.core.program import run_prompt
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams
from helios.engine.speculation.drafter import SpeculationConfig
from helios.frontend.constraint import ConstraintPlan, GrammarConstraint, GrammarMasks
from helios.frontend.grammar import GrammarService
from ignition.export import ExportOptions, export_core
from ignition.models.mtp import run_mtp_prompt
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.engine.speculation_checks import same_tokens

pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)

SAMPLED = SamplingParams(0.8, 0.95, -1, 0.0, 1.0, 0.0, 0.0, 21)
OFF = SpeculationConfig(mode="off")
HISTORY = SpeculationConfig(mode="fixed", max_drafts=4, learned=False)
MTP = SpeculationConfig(mode="fixed", max_drafts=3, history=False)
BOTH = SpeculationConfig(mode="adaptive", max_drafts=4, row_budget=64)
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3


# name -> (family, recipe, test config changes)
CORES = {
    "mimo_v2": ("mimo_v2", "mimo_v2", {}),
    "deepseek_v3": ("kimi_k3", "kimi3", {"num_nextn_predict_layers": 1}),
    "qwen3_next": ("qwen3_next", "qwen38", {"mtp_num_hidden_layers": 1}),
}


@pytest.fixture(scope="module", params=sorted(CORES))
def core(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Core:
    family, recipe, overrides = CORES[request.param]
    checkpoint = write_testmodel(
        family, tmp_path_factory.mktemp("ckpt") / f"tiny-{request.param}", seed=3, overrides=overrides
    )
    out = tmp_path_factory.mktemp("cores") / f"tiny-{request.param}"
    export_core(open_source(str(checkpoint)), load_recipe(recipe), ExportOptions(out=out, prompt_logprobs=True))
    core = Core.open(out)
    assert "mtp_draft.0" in core.manifest.programs
    return core


def _prompts(core: Core) -> list[tuple[int, ...]]:
    tok = core.tokenizer()
    return [
        tuple(tok.encode(text).ids)
        for text in (CODE, "the cat sat on the mat and the cat sat on the hat, " * 2, "One, two, three, four, five")
    ]


def _run(core: Core, requests: list[EngineRequest], speculation: SpeculationConfig, **config):
    engine = build_engine(core, EngineConfig(num_pages=config.pop("num_pages", 96), speculation=speculation, **config))
    out = run_to_completion(engine, requests)
    _check_nothing_held(engine)
    return out, engine


def _check_nothing_held(engine: LLMEngine) -> None:
    engine.scheduler.check_invariants()
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages  # no page left to a sequence
    assert engine.scheduler.drafter.num_tracked == 0  # no draft state left
    assert engine.learned is None or engine.learned.num_tracked == 0


def _cancel_while_drafting(engine: LLMEngine, requests: list[EngineRequest], steps: int) -> None:
    """Add the requests and step until the learned drafter tracks some, then cancel r0 and n2's
    second choice mid-generation."""
    for request in requests:
        engine.add(request)
    for _ in range(steps):
        engine.step()
    assert engine.learned is not None and engine.learned.num_tracked > 0
    engine.abort("r0")
    engine.abort("n2", 1)


def _server_values(engine: LLMEngine):
    """What /metrics reports (ServerState.snapshot) of an idle server around `engine`."""
    from helios.server.outcomes import RequestOutcomes
    from helios.server.state import ServerState

    state = SimpleNamespace(
        outcomes=RequestOutcomes(),
        client=SimpleNamespace(metrics=engine.metrics),
        slots=SimpleNamespace(in_use=0, capacity=1),
        started=0.0,
        frontend=SimpleNamespace(image_counters={}),
    )
    return ServerState.snapshot(state)  # type: ignore[arg-type]


def _same(a, b, tolerance: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            assert x.token_ids == y.token_ids and x.finish == y.finish, key
            assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)
            for p, q in zip(x.prompt_logprobs or (), y.prompt_logprobs or (), strict=True):
                assert (p is None) == (q is None) and (p or {}).keys() == (q or {}).keys()
                assert all(abs(p[t].logprob - q[t].logprob) <= tolerance for t in p or {})
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert abs(p.logprob - q.logprob) <= tolerance
                assert [t for t, _ in p.alternatives] == [t for t, _ in q.alternatives]
                assert (
                    max((abs(u - v) for (_, u), (_, v) in zip(p.alternatives, q.alternatives)), default=0) <= tolerance
                )


def _requests(core: Core, max_tokens: int = 24) -> list[EngineRequest]:
    prompts = _prompts(core)
    plain = [
        EngineRequest(f"r{i}", p, (GREEDY,), max_tokens, ignore_eos=True, num_top_logprobs=2)
        for i, p in enumerate(prompts)
    ]
    two = EngineRequest("n2", prompts[1], (GREEDY, SAMPLED), max_tokens, ignore_eos=True, num_top_logprobs=2)
    return plain + [two]


def test_output_is_the_same_with_speculation_off_history_and_mtp(core: Core) -> None:
    requests = _requests(core)
    off, _ = _run(core, requests, OFF)
    stop = tuple(off["r0"][0].token_ids[10:12])  # a token stop sequence verification reaches inside a round
    requests.append(
        EngineRequest(
            "stop", _prompts(core)[0], (GREEDY,), 24, ignore_eos=True, num_top_logprobs=2, stop_token_sequences=(stop,)
        )
    )
    # prompt logprobs: the scored-prefill program's hidden states feed the MTP layer too
    requests.append(
        EngineRequest(
            "scored", _prompts(core)[2], (GREEDY,), 16, ignore_eos=True, num_top_logprobs=2, prompt_logprobs=1
        )
    )
    off, plain = _run(core, requests, OFF)
    assert off["stop"][0].finish is FinishCause.STOP_TOKEN and len(off["stop"][0].token_ids) < 24
    assert plain.learned is None and plain.stats.draft_steps == 0
    history, engine = _run(core, requests, HISTORY)
    _same(off, history)
    assert engine.learned is None and engine.stats.draft_steps == 0
    # the tiny Qwen3-Next's greedy text never repeats an n-gram of its prompt: history has nothing to offer
    assert engine.stats.accepted_drafts > 0 or core.manifest.kv.state
    for speculation in (MTP, BOTH):
        spec, engine = _run(core, requests, speculation)
        _same(off, spec)
        stats = engine.stats
        assert engine.learned is not None and stats.draft_steps > 0
        assert (
            0 < stats.learned_offered <= stats.verification_drafts and stats.learned_accepted <= stats.learned_offered
        )
        assert stats.accepted_drafts <= stats.verification_drafts


def _recording(engine: LLMEngine) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(committed tokens, the MTP proposal made after them) for every proposal the engine makes."""
    records: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    learned = engine.learned
    assert learned is not None
    observe = learned.observe

    def recorded(plan, hidden, tables, depths):
        observe(plan, hidden, tables, depths)
        for seq in engine.scheduler.running:
            if learned.proposal(seq):
                records.append((tuple(seq.token_ids), learned.proposal(seq)))

    learned.observe = recorded  # type: ignore[method-assign]
    return records


def _check_against_reference(core: Core, records, finals: list[list[int]]) -> int:
    """Each proposal's drafts are the argmax of the reference MTP chain over its committed tokens:
    draft 1 from the MTP layer over every committed position (fed the step program's own hidden
    states), draft j + 1 one position on, fed draft j and the previous MTP row's hidden state."""
    m, weights, page = core.manifest, core.load_weights(), core.manifest.limits.page_tokens
    step, mtp = core.load_program(), core.load_program("mtp_draft.0")
    hidden_of = {}
    checked = 0
    for tokens, drafts in records:
        final = next(f for f in finals if f[: len(tokens)] == list(tokens))
        key = tuple(final)
        if key not in hidden_of:
            hidden_of[key] = run_prompt(step, weights, m.kv, page, final[:-1]).outputs["hidden_states"]
        hidden = hidden_of[key][: len(tokens) - 1]  # main hidden states of positions 0 .. L-2
        next_ids = list(tokens[1:])
        for draft in drafts:
            out = run_mtp_prompt(mtp, weights, m.kv, page, next_ids, hidden)
            logprobs = out["logits"][-1] - out["logsumexp"][-1]
            assert float(logprobs.max() - logprobs[draft]) <= 1e-4, (len(tokens), drafts)
            next_ids.append(draft)
            hidden = torch.cat([hidden, out["hidden_states"][-1:]])
            checked += 1
    return checked


def test_mtp_proposals_follow_the_reference_mtp_over_committed_tokens(core: Core) -> None:
    """Fixed depth 3, so most rounds reject a draft: the KV the MTP layer keeps after each must be
    that of the committed tokens (speculative rows overwritten), for a single choice and n = 2."""
    requests = _requests(core, max_tokens=20)
    engine = build_engine(core, EngineConfig(num_pages=96, speculation=MTP))
    records = _recording(engine)
    out = run_to_completion(engine, requests)
    _check_nothing_held(engine)
    finals = [list(r.prompt_ids) + c.token_ids for r in requests for c in out[r.request_id]]
    assert len({len(t) for t, _ in records}) > 10 and any(len(d) == 3 for _, d in records)
    assert _check_against_reference(core, records, finals) >= 3 * len(requests) * 5


def test_preemption_and_cancellation_leave_nothing_behind(core: Core) -> None:
    """A pool too small for every request at once (preemption, recompute) and cancellations
    mid-generation: same output as plain decoding, every page back, no draft state kept."""
    requests = _requests(core, max_tokens=28)
    again = requests[1:] + [replace(requests[1], request_id="r1b")]  # the short prompts: they all get admitted
    off, _ = _run(core, again, OFF, num_pages=8, prefill_chunk_size=16)
    engine = build_engine(core, EngineConfig(num_pages=8, prefill_chunk_size=16, speculation=MTP))
    records = _recording(engine)
    spec = run_to_completion(engine, again)
    _check_nothing_held(engine)
    assert engine.stats.preemptions > 0 and engine.stats.draft_steps > 0
    same_tokens(spec, off)
    finals = [list(r.prompt_ids) + c.token_ids for r in again for c in spec[r.request_id]]
    assert _check_against_reference(core, records[::4], finals) > 0  # recomputed after preemption, reused pages
    engine = build_engine(core, EngineConfig(num_pages=96, speculation=MTP))
    _cancel_while_drafting(engine, requests, 6)
    engine.step()
    while engine.has_work:
        if engine.stats.steps == 9:
            engine.abort("r1")
        engine.step()
    _check_nothing_held(engine)


def test_metrics_name_the_learned_drafter(core: Core) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from helios.server.metrics import FirstResponseWindow, json_snapshot, prometheus_text

    window = FirstResponseWindow().summary(now=0.0)
    for speculation, name in ((MTP, "mtp"), (HISTORY, None), (OFF, None)):
        engine = build_engine(core, EngineConfig(num_pages=32, speculation=speculation))
        run_to_completion(engine, _requests(core, max_tokens=6)[:1])
        values = _server_values(engine)
        snapshot = json_snapshot(values, window)
        assert snapshot["learned_drafter"] is (name is not None) and snapshot["learned_drafter_name"] == name
        assert (snapshot["draft_steps"] > 0) is (name is not None)
        text = prometheus_text(values, window)
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert not any("learned_drafter" in s or "draft_steps" in s for s in samples)  # api.md: none in the text
        assert samples["flare_learned_draft_tokens_total"] == engine.stats.learned_offered


def test_history_wins_only_with_a_long_match_filling_the_depth() -> None:
    """Drafter.propose: history's proposal from a 4-token match covering the depth, else the
    learned one (counted as learned when verified), else the shorter history."""
    from helios.engine.request import EngineStats
    from helios.engine.sequence import Sequence
    from helios.engine.speculation.drafter import Drafter

    stats = EngineStats()
    drafter = Drafter(SpeculationConfig(mode="fixed", max_drafts=3, shared_history=False), stats)
    learned = {"drafts": (7, 7, 7)}
    drafter.learned = SimpleNamespace(name="x", proposal=lambda seq: learned["drafts"], forget=lambda seq: None)
    request = EngineRequest("a", (1,), (GREEDY,), 50)
    copying = Sequence(request, 0, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 10, 0)
    assert drafter.propose(copying, 3) == (5, 6, 1) and drafter.history_wins(copying, 3)
    assert drafter.propose(copying, 7) == (7, 7, 7)  # only 6 tokens follow the match: learned
    short = Sequence(request, 0, [1, 2, 3, 9, 5, 1, 2, 3], 8, 1)  # a 3-token match only
    assert drafter.propose(short, 3) == (7, 7, 7) and not drafter.history_wins(short, 3)
    drafter.verified(short, 3, 1)
    assert (stats.learned_offered, stats.learned_accepted) == (3, 1)
    learned["drafts"] = ()
    assert drafter.propose(short, 3) == (9, 5, 1)  # no learned proposal: the history's
    drafter.verified(short, 3, 0)
    assert (stats.learned_offered, stats.learned_accepted) == (3, 1)
    for seq in (copying, short):
        drafter.finished(seq)
    assert drafter.num_tracked == 0


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def test_learned_drafts_follow_the_grammar_of_a_constrained_answer(core: Core) -> None:
    """Under a JSON schema, each learned draft is the likeliest token the grammar allows after the
    drafts before it (not the unconstrained argmax, which the scheduler would cut at the first
    token the grammar rejects): every proposal is a valid continuation, and the answers are those
    of plain decoding."""
    m = core.manifest
    service = GrammarService(core.tokenizer(), m.tokenizer.vocab_size, tuple(m.tokenizer.eos_token_ids))
    matcher = service.compile("json_schema", json.dumps(SCHEMA), "response_format")
    plan = ConstraintPlan(None, None, frozenset(), False)
    requests = [
        EngineRequest(f"j{i}", prompt, (GREEDY,), 20, num_top_logprobs=1, constraint=GrammarConstraint(matcher, plan))
        for i, prompt in enumerate(_prompts(core))
    ]

    def run(speculation: SpeculationConfig, record: bool = False):
        engine = build_engine(
            core, EngineConfig(num_pages=96, speculation=speculation), mask_hook=GrammarMasks(m.tokenizer.vocab_size)
        )
        proposals: list[tuple[GrammarConstraint, tuple[int, ...], int]] = []  # (state, drafts, depth asked)
        if record:
            learned, observe = engine.learned, engine.learned.observe

            def recorded(plan, hidden, tables, depths):
                observe(plan, hidden, tables, depths)
                for seq in engine.scheduler.running:
                    if id(seq) in depths and seq.constraint is not None:
                        proposals.append((seq.constraint.fork(), learned.proposal(seq), depths[id(seq)]))

            learned.observe = recorded
        out = run_to_completion(engine, requests)
        _check_nothing_held(engine)
        return out, engine, proposals

    off, _, _ = run(OFF)
    spec, engine, proposals = run(MTP, record=True)
    _same(off, spec)
    assert proposals and engine.stats.learned_offered > 0
    for state, drafts, _ in proposals:
        assert drafts and all(state.advance(token) for token in drafts), drafts
    # The unconstrained argmax of this random model leaves almost nothing the grammar accepts
    # (measured: most proposals empty); masked, chains reach the depth asked unless the answer ends.
    assert sum(len(drafts) for _, drafts, _ in proposals) >= 0.9 * sum(depth for _, _, depth in proposals)
