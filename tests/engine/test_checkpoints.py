"""Prefix checkpoints chosen from the prompt's structure: the frontend's candidate positions (the
conversation anchor, message ends, cache_control block ends) are exact token boundaries; hybrid
cores' scheduler snapshots the chosen ones under a work allowance (unknown_cost, work_budget
skips) and a later prompt resumes there with the uncached output; attention cores are unchanged."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from support import TinyCores

from helios.config import ServerConfig
from helios.core import Core
from helios.core.template import ChatTemplate
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.memory.checkpoints import StepCosts
from helios.engine.memory.kv_cache import PagePool
from helios.engine.memory.state_slots import StatePool
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, EngineStats
from helios.engine.scheduler import Scheduler, SchedulerConfig
from helios.frontend.request import Frontend
from helios.protocols.anthropic_messages import decode
from tests.engine.test_scheduler import PAGE, PARAMS, _request, _step

VERSION = "2023-06-01"
CACHED = {"type": "ephemeral"}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
DOCUMENT = ("Here is a long document about foxes and dogs. " * 4).strip()


def _body(system: str, last: str) -> dict:
    """system + tools, then three user turns; the 2nd user turn's first block carries cache_control."""
    return {
        "model": "x",
        "max_tokens": 8,
        "system": system,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Hello there, who are you?"},
            {"role": "assistant", "content": "I am a helpful model."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": DOCUMENT, "cache_control": CACHED},
                    {"type": "text", "text": last},
                ],
            },
        ],
    }


# ---------------------------------------------------------------------------- scheduler (no model)
def _costs(fixed: int = 900, per_token: int = 100, copy: float = 1.0) -> StepCosts:
    costs = StepCosts()
    costs.observe_step(1, fixed + per_token)
    costs.observe_step(17, fixed + 17 * per_token)
    costs.observe_copy(1000, round(1000 * copy))
    return costs


def _hybrid(costs: StepCosts, fraction: float = 1.0, interval: int = 0, chunk: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(4, chunk, 1024, snapshot_interval=interval, checkpoint_work_fraction=fraction),
        PagePool(32, PAGE),
        EngineStats(total_pages=32, page_tokens=PAGE, state_slot_bytes=100),
        states=StatePool(4, 8),
        costs=costs,
    )


def _chunk_ends(s: Scheduler) -> list[int]:
    ends = []
    while True:
        plan, _ = _step(s)
        chunk = plan.chunks[0]
        ends.append(chunk.start + chunk.num_tokens)
        if chunk.wants_logits:
            return ends


HINTS = ((9, "anchor"), (13, "message"), (18, "message"), (21, "cache_control"))


def test_step_costs_fit_a_line_once_two_step_sizes_were_seen() -> None:
    costs = StepCosts()
    assert costs.prefill_ns(100, 64) is None and costs.capture_ns(100) is None
    costs.observe_step(8, 1700)
    assert costs.fixed_ns is None  # one size cannot separate the fixed cost from the per-token one
    costs = _costs(fixed=900, per_token=100, copy=2.0)
    assert costs.fixed_ns == pytest.approx(900) and costs.prefill_ns(100, 64) == pytest.approx(2 * 900 + 100 * 100)
    assert costs.capture_ns(100) == pytest.approx(900 + 200)


def test_hints_are_captured_in_priority_order_within_the_allowance() -> None:
    # capture = 900 (a step more) + 100 (copy); allowance = 1.0 x (900 + 30 x 100) = 3900: three fit
    s = _hybrid(_costs(), fraction=1.0)
    s.add(_request("a", 30, max_tokens=1, checkpoint_hints=HINTS))
    # anchor 8, cache_control 20, then message ends latest first: 16; 12 is over the allowance
    assert _chunk_ends(s) == [8, 16, 20, 28, 30]
    assert s.stats.checkpoint_captures == {"anchor": 1, "message": 3}  # 16, 20 and the last page boundary 28
    assert s.stats.checkpoint_skips == {"work_budget": 1}
    assert s.stats.checkpoint_extra_work_ns == 3000
    assert s.states.snapshots_held == 4


def test_unknown_costs_and_a_spent_allowance_skip_hints_without_extra_chunks() -> None:
    s = _hybrid(StepCosts())
    s.add(_request("a", 30, max_tokens=1, checkpoint_hints=HINTS))
    assert _chunk_ends(s) == [28, 30]
    assert s.stats.checkpoint_skips == {"unknown_cost": 4} and "anchor" not in s.stats.checkpoint_captures
    s = _hybrid(_costs(), fraction=0.0)
    s.add(_request("a", 30, max_tokens=1, checkpoint_hints=HINTS))
    assert _chunk_ends(s) == [28, 30]
    assert s.stats.checkpoint_skips == {"work_budget": 4} and s.stats.checkpoint_extra_work_ns == 0


def test_a_hint_on_a_planned_boundary_costs_nothing() -> None:
    s = _hybrid(StepCosts(), interval=8)  # 8, 16, 24 are snapshotted anyway
    s.add(_request("a", 30, max_tokens=1, checkpoint_hints=((9, "anchor"), (17, "cache_control"))))
    assert _chunk_ends(s) == [8, 16, 24, 28, 30]
    assert s.stats.checkpoint_captures == {"anchor": 1, "message": 2} and not s.stats.checkpoint_skips
    assert s.stats.checkpoint_extra_work_ns == 0


def test_attention_cores_ignore_hints() -> None:
    plans = []
    for hints in ((), HINTS):
        s = Scheduler(SchedulerConfig(4, 8, 1024), PagePool(32, PAGE))
        s.add(_request("a", 30, max_tokens=2, checkpoint_hints=hints))
        plans.append(_attention_chunks(s))
    assert plans[0] == plans[1] == [(0, 8), (8, 8), (16, 8), (24, 6), (30, 1)]


def _attention_chunks(s: Scheduler) -> list[tuple[int, int]]:
    chunks = []
    while s.has_work:
        chunks += [(c.start, c.num_tokens) for c in _step(s)[0].chunks]
    return chunks


def test_anchor_snapshots_are_evicted_last() -> None:
    pool = StatePool(1, 4)
    for digest, anchor in ((b"a", True), (b"b", False), (b"c", False), (b"d", False)):
        pool.register(digest, pool.claim(), anchor)
    pool.register(b"e", pool.claim())  # the oldest non-anchor (b) goes, not the older anchor
    assert pool.has(b"a") and not pool.has(b"b")
    for digest in (b"f", b"g"):  # anchors past half of the slots lose their protection
        pool.register(digest, pool.claim(), True)
    pool.register(b"h", pool.claim())
    assert not pool.has(b"a") and pool.has(b"f")
    pool.check(0)


def test_anchor_guards_keep_slots_for_anchors() -> None:
    pool = StatePool(1, 6, anchor_guards=2)
    assert pool.unused_guards == 2
    for digest in (b"m1", b"m2", b"m3", b"m4"):  # other captures fill the four unguarded slots
        pool.register(digest, pool.claim(), False)
    pool.register(b"m5", pool.claim())  # the guards stay free: the oldest snapshot is replaced
    assert not pool.has(b"m1") and pool.unused_guards == 2
    armed = pool.claim(anchor=True)  # an anchor capture planned: its guard is armed, not unused
    assert armed is not None and pool.unused_guards == 1
    pool.unclaim(armed)  # its step failed: the guard is unused again
    assert pool.unused_guards == 2
    pool.register(b"a1", pool.claim(anchor=True), True)
    assert pool.unused_guards == 1
    slot = pool.pin(b"a1")  # the host store copying the anchor: it still holds its guard
    assert pool.unused_guards == 1
    pool.unpin(slot)
    pool.register(b"a2", pool.claim(anchor=True), True)
    assert pool.unused_guards == 0
    pool.register(b"m6", pool.claim())  # no guard left unused: a plain capture replaces m2, not an anchor
    assert not pool.has(b"m2") and pool.has(b"a1") and pool.has(b"a2")
    pool.check(0)


def test_no_guards_when_asked_for_none() -> None:
    pool = StatePool(1, 2, anchor_guards=0)
    assert pool.unused_guards == 0
    assert pool.claim() is not None and pool.claim() is not None
    assert StatePool(1, 8).anchor_guards == 2  # default: a quarter of the snapshot slots


# ---------------------------------------------------------------------------- a tiny hybrid core
@pytest.fixture(scope="module")
def hybrid(tiny_cores: TinyCores) -> Path:
    """The tiny Qwen3-Next core (seed 4, qwen38, 16-token pages) that test_hybrid_state serves."""
    return tiny_cores("qwen3_next", "qwen38", 4, page_tokens=16)[1]


@pytest.fixture(scope="module")
def frontend(hybrid: Path) -> Frontend:
    return Frontend(Core.open(hybrid), ServerConfig())


def _engine_request(frontend: Frontend, body: dict, request_id: str) -> EngineRequest:
    request, _ = decode(body, headers_version=VERSION)
    engine_request = frontend.prepare(replace(request, max_tokens=8), request_id).inputs[0].engine
    return replace(engine_request, request_id=request_id, params=(PARAMS,), ignore_eos=True)  # type: ignore[arg-type]


def _engine(core: Path, **overrides) -> LLMEngine:
    config = {"num_pages": 256, "prefill_chunk_size": 2048, "snapshot_interval": 0, **overrides}
    return build_engine(Core.open(core), EngineConfig(**config))


def _text(frontend: Frontend, ids) -> str:
    return frontend.tokenizer.decode(list(ids), skip_special_tokens=False)


CHATML_TOOLS = (  # a ChatML template that renders a system-only prefix (qwen3.5's refuses one)
    "{%- if tools %}<|im_start|>system\n{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n"
    "{% endif %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{%- elif messages and messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}{%- for m in messages %}{% if m.role != 'system' or not loop.first %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["qwen3.5", "chatml"])
def test_candidate_positions_are_exact_token_boundaries(frontend: Frontend, template: str) -> None:
    if template == "chatml":
        frontend = replace_template(frontend, CHATML_TOOLS)
    request, _ = decode(_body("You are a careful assistant.", "Summarize it please."), headers_version=VERSION)
    conversation = request.input
    prompt = frontend.prompt(conversation)
    rendering = frontend.rendering(conversation)
    prefixes = {rendering.render(rendering.dicts[:k]) for k in range(2, len(rendering.dicts) + 1)}
    roles = {
        role: [pos for pos, r in prompt.checkpoint_hints if r == role]
        for role in ("anchor", "message", "cache_control")
    }
    assert len(roles["anchor"]) == 1 and len(roles["message"]) == 3 and len(roles["cache_control"]) == 1
    for position in roles["message"]:  # the prompt's text up to the position is the messages' own rendering
        assert _text(frontend, prompt.token_ids[:position]) in prefixes
    anchor = _text(frontend, prompt.token_ids[: roles["anchor"][0]])
    assert "You are a careful assistant." in anchor and "get_weather" in anchor and "Hello there" not in anchor
    if template == "chatml":
        assert anchor == rendering.render(rendering.dicts[:1])  # the system + tools block exactly
    else:  # no system-only rendering: the part every conversation with this block and a user turn shares
        assert anchor.endswith("<|im_end|>\n<|im_start|>user\n")
    block = _text(frontend, prompt.token_ids[: roles["cache_control"][0]])
    assert block.endswith(DOCUMENT) and prompt.text[len(block) :].startswith("\n\nSummarize it please.")


def replace_template(frontend: Frontend, source: str) -> Frontend:
    clone = object.__new__(Frontend)
    for name in (
        "manifest",
        "config",
        "tokenizer",
        "literal",
        "vocab_size",
        "max_model_len",
        "bounds",
        "checkpoint_hints",
        "anchor_hints",
        "native",
        "grammars",
        "vision",
    ):
        setattr(clone, name, getattr(frontend, name))
    clone.template = ChatTemplate(source, frontend.template.special_tokens)
    return clone


def test_attention_cores_get_only_the_anchor_and_only_with_a_host_store(tiny_core: Path) -> None:
    request, _ = decode(_body("You are terse.", "Go."), headers_version=VERSION)
    hints = Frontend(Core.open(tiny_core), ServerConfig()).prompt(request.input).checkpoint_hints
    assert [role for _, role in hints] == ["anchor"]  # the host store keeps the anchor's chain longest
    assert Frontend(Core.open(tiny_core), ServerConfig(host_cache=False)).prompt(request.input).checkpoint_hints == ()


def test_skips_are_counted_while_costs_are_unknown_and_past_the_allowance(hybrid: Path, frontend: Frontend) -> None:
    engine = _engine(hybrid, checkpoint_work_fraction=1e-9)
    run_to_completion(engine, [_engine_request(frontend, _body("You are a careful assistant.", "Go."), "first")])
    assert engine.stats.checkpoint_skips.get("unknown_cost", 0) >= 2  # no step measured yet: anchor, block, messages
    assert "work_budget" not in engine.stats.checkpoint_skips
    run_to_completion(engine, [_engine_request(frontend, _body("You are another assistant.", "Go."), "second")])
    assert engine.stats.checkpoint_skips.get("work_budget", 0) >= 2  # measured now, but the allowance is tiny
    assert "anchor" not in engine.stats.checkpoint_captures and engine.stats.checkpoint_extra_work_ns == 0
    assert engine.stats.checkpoint_captures == {"message": 2}  # each prompt's last page boundary only


def test_a_cache_control_block_end_is_resumed_by_a_later_request(hybrid: Path, frontend: Frontend) -> None:
    engine = _engine(hybrid, checkpoint_work_fraction=100.0)
    warm = EngineRequest("warm", tuple(range(10, 50)), (PARAMS,), 4, ignore_eos=True)
    run_to_completion(engine, [warm])  # a prefill and decode steps: the step costs are measured
    first = _engine_request(frontend, _body("You are a careful assistant.", "Summarize it please."), "first")
    run_to_completion(engine, [first])
    assert engine.stats.checkpoint_captures.get("anchor") == 1
    assert engine.stats.checkpoint_captures.get("message", 0) >= 2  # the block end and message ends
    assert engine.stats.checkpoint_extra_work_ns > 0 and not engine.stats.checkpoint_skips
    block = next(pos for pos, role in first.checkpoint_hints if role == "cache_control")
    size = Core.open(hybrid).manifest.limits.page_tokens
    # the same conversation up to the marked block, then a different question
    later = _engine_request(frontend, _body("You are a careful assistant.", "What do the dogs do?"), "later")
    assert later.prompt_ids[:block] == first.prompt_ids[:block]
    prefilled = engine.stats.prefill_tokens
    resumed = run_to_completion(engine, [later])["later"][0]
    assert resumed.num_cached_tokens == block // size * size  # prefill starts at the block end's page boundary
    assert engine.stats.prefill_tokens - prefilled == len(later.prompt_ids) - resumed.num_cached_tokens
    uncached = run_to_completion(_engine(hybrid, enable_prefix_cache=False), [later])["later"][0]
    assert resumed.token_ids == uncached.token_ids
    engine.scheduler.check_invariants()
    engine.states.check(0)
