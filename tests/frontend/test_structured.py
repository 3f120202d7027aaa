"""Structured output below the HTTP layer: compiling against a core tokenizer, batched masks,
the answer-only constraint state machine, the engine's use of it, and verbatim answers."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helios.config import ServerConfig
from helios.core import Core
from helios.engine import EngineConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause, ReasoningBudget
from helios.engine.sampling_params import GREEDY
from helios.frontend.constraint import ConstraintPlan, GrammarConstraint, GrammarMasks, Phase
from helios.frontend.events import ReasoningEvent, TextEvent
from helios.frontend.grammar import GrammarError, GrammarService
from helios.frontend.inference import (
    Conversation,
    InferenceRequest,
    Message,
    OutputConstraint,
    RequestError,
    StopOptions,
    TextPart,
)
from helios.frontend.output import Piece
from helios.frontend.parsers import build_parser
from helios.frontend.parsers.tools import ToolCallError
from helios.frontend.request import Frontend

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "ages": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    },
    "required": ["kind", "ages"],
    "additionalProperties": False,
}
LARK = 'start: "a" B\nB: /[bc]+/'


@pytest.fixture(scope="module")
def core(qwen3_core: Path) -> Core:
    return Core.open(qwen3_core, verify_checksums=False)


@pytest.fixture(scope="module")
def frontend(core: Core) -> Frontend:
    return Frontend(core, ServerConfig())


@pytest.fixture(scope="module")
def service(frontend: Frontend) -> GrammarService:
    return frontend.grammars


def _ids(frontend: Frontend, text: str) -> list[int]:
    return frontend.tokenizer.encode(text, add_special_tokens=False).ids


def _allowed(matcher) -> torch.Tensor:
    """llguidance's own single-matcher mask as bool [V], the reference for the batched hook."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    return ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()


def _plan(frontend: Frontend, inside: bool = False, tools: bool = True) -> ConstraintPlan:
    tok = frontend.tokenizer
    openers = frozenset({tok.token_to_id("<tool_call>")}) if tools else frozenset()
    return ConstraintPlan(tok.token_to_id("<think>"), tok.token_to_id("</think>"), openers, inside)


@pytest.mark.parametrize(
    ("kind", "definition", "good", "bad"),
    [
        ("json_schema", json.dumps(SCHEMA), '{"kind": "dog", "ages": [3, 12]}', '{"kind": "cow", "ages": []}'),
        ("json_object", "", '{"a": [1, {"b": null}]}', "[1, 2]"),
        ("lark", LARK, "abcb", "ab a"),
        ("regex", r"(red|blue)-\d{1,2}", "blue-42", "blue-420"),
    ],
)
def test_each_format_accepts_its_language_and_masks_the_rest(frontend, service, kind, definition, good, bad) -> None:
    pristine = service.compile(kind, definition, "response_format")
    assert service.compile(kind, definition, "response_format") is pristine  # cached
    constraint = GrammarConstraint(pristine, _plan(frontend)).fork()
    masks = GrammarMasks(frontend.vocab_size)
    eos = frontend.manifest.tokenizer.eos_token_ids[0]
    for token in _ids(frontend, good):
        allowed = masks([SimpleNamespace(constraint=constraint)])
        assert allowed is not None and bool(allowed[0, token])
        assert constraint.advance(token)
    assert bool(masks([SimpleNamespace(constraint=constraint)])[0, eos])  # complete: EOS is allowed
    rejected = GrammarConstraint(pristine, _plan(frontend)).fork()
    assert not all(rejected.advance(t) for t in _ids(frontend, bad)) or not rejected.matcher.is_accepting()


def test_batched_masks_match_each_matcher_and_keep_free_rows_open(frontend, service) -> None:
    pristine = service.compile("lark", LARK, "f")
    started = GrammarConstraint(pristine, _plan(frontend, tools=False)).fork()
    started.advance(_ids(frontend, "a")[0])
    fresh = GrammarConstraint(pristine, _plan(frontend)).fork()
    reasoning = GrammarConstraint(pristine, _plan(frontend, inside=True)).fork()
    broken = GrammarConstraint(pristine, _plan(frontend)).fork()
    broken.advance(_ids(frontend, "z")[0])  # outside the grammar: the matcher enters its error state
    seqs = [SimpleNamespace(constraint=c) for c in (None, started, fresh, reasoning, broken)]
    allowed = GrammarMasks(frontend.vocab_size)(seqs)
    vocab = frontend.vocab_size
    assert allowed is not None and allowed.shape == (5, vocab) and allowed.dtype == torch.bool
    assert bool(allowed[0].all()) and bool(allowed[3].all())  # unconstrained, and free reasoning
    assert torch.equal(allowed[1], _allowed(started.matcher)[:vocab])
    extras = torch.zeros(vocab, dtype=torch.bool)
    extras[list(fresh.extra_ids)] = True  # before the answer: the reasoning and tool openers too
    assert torch.equal(allowed[2], _allowed(fresh.matcher)[:vocab] | extras)
    assert not bool(allowed[4].any()) and broken.error  # the engine finishes this choice with the error


def test_answer_only_phases(frontend, service) -> None:
    tok = frontend.tokenizer
    think, close, call = tok.token_to_id("<think>"), tok.token_to_id("</think>"), tok.token_to_id("<tool_call>")
    pristine = service.compile("json_object", "", "f")
    c = GrammarConstraint(pristine, _plan(frontend)).fork()
    assert c.active and set(c.extra_ids) == {think, call}
    assert c.advance(think) and c.phase is Phase.REASONING and not c.active
    for token in _ids(frontend, "not json {"):
        assert c.advance(token) and not c.active  # reasoning is free
    assert c.advance(close) and c.phase is Phase.START and c.extra_ids == (call,)  # reasoning opens once
    assert c.advance(_ids(frontend, "{")[0]) and c.phase is Phase.ANSWER and c.extra_ids == ()
    assert not c.advance(think) and c.error  # inside the answer every token is the grammar's
    tool = GrammarConstraint(pristine, _plan(frontend)).fork()
    assert tool.advance(call) and tool.phase is Phase.FREE and not tool.active and tool.advance(think)
    implicit = GrammarConstraint(pristine, _plan(frontend, inside=True)).fork()
    assert implicit.advance(call) and implicit.phase is Phase.FREE  # a tool opener also ends reasoning


def test_compile_errors_name_the_field(frontend, service) -> None:
    cases = [
        ("json_schema", json.dumps({"type": "nonsense"}), "Invalid type"),
        ("json_schema", json.dumps({"type": "array", "uniqueItems": True}), "uniqueItems"),
        ("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 3}), "nsatisfiable"),
        ("lark", "start: missing", "unknown name"),
        ("regex", "((", "unclosed"),
        ("regex", "a" * 70000, "limit"),
        ("yaml", "x", "unknown output format"),
    ]
    for kind, definition, needle in cases:
        with pytest.raises(GrammarError) as info:
            service.compile(kind, definition, "text.format.schema")
        assert info.value.field == "text.format.schema" and needle in info.value.message
    with pytest.raises(RequestError) as wrapped:
        frontend.compile_output(OutputConstraint("lark", "start: missing", "response_format.definition"))
    assert wrapped.value.param == "response_format.definition"


def test_compile_time_is_bounded(core) -> None:
    slow = GrammarService(core.tokenizer(), core.manifest.tokenizer.vocab_size, (0,), timeout_s=0.0)
    with pytest.raises(GrammarError, match="longer than"):
        slow.compile("regex", "(a|b){1,200}c{1,200}", "response_format")


def test_options_an_output_constraint_excludes(frontend) -> None:
    conversation = Conversation((Message("user", (TextPart("hi"),)),))
    output = OutputConstraint("json_object", "", "response_format")
    rejected = [
        (InferenceRequest(conversation, {}, 8, stop=StopOptions(strings=("x",)), output=output), "stop"),
        (InferenceRequest(conversation, {}, 8, stop=StopOptions(token_ids=(3,)), output=output), "stop"),
        (InferenceRequest(conversation, {}, 8, stop=StopOptions(ignore_eos=True), output=output), "ignore_eos"),
        (
            InferenceRequest(
                Conversation(
                    conversation.messages + (Message("assistant", (TextPart("{"),)),),
                    add_generation_prompt=False,
                    continue_final_message=True,
                ),
                {},
                8,
                output=output,
            ),
            "response_format",
        ),
    ]
    for request, param in rejected:
        with pytest.raises(RequestError) as info:
            frontend.check_options(request)
        assert info.value.param == param
    frontend.check_options(InferenceRequest(conversation, {}, 8, output=output))


def test_json_formats_instruct_the_system_prompt(frontend) -> None:
    conversation = Conversation((Message("system", (TextPart("Be terse."),)), Message("user", (TextPart("hi"),))))
    schema = frontend.render(conversation, OutputConstraint("json_schema", json.dumps(SCHEMA), "response_format"))
    assert "Be terse.\n\nRespond with only a JSON value that conforms to this JSON schema" in schema
    assert json.dumps(SCHEMA) in schema
    assert "only a JSON object" in frontend.render(conversation, OutputConstraint("json_object", "", "f"))
    assert frontend.render(conversation, OutputConstraint("regex", "a", "f")) == frontend.render(conversation)


def test_engine_forced_close_advances_the_constraint_then_masks_the_answer(core, frontend, service) -> None:
    tok = frontend.tokenizer
    think, close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    eos = core.manifest.tokenizer.eos_token_ids[0]
    constraint = GrammarConstraint(service.compile("regex", "[ab]{3}", "f"), _plan(frontend, inside=True, tools=False))
    prompt = tuple(_ids(frontend, "hello there")) + (think,)
    request = EngineRequest(
        "r",
        prompt,
        (GREEDY, replace(GREEDY, seed=5)),
        12,
        constraint=constraint,
        reasoning_budget=ReasoningBudget(2, think, close),
    )
    engine = build_engine(core, EngineConfig(num_pages=64), mask_hook=GrammarMasks(frontend.vocab_size))
    for choice in run_to_completion(engine, [request])["r"]:
        assert choice.finish is FinishCause.EOS, choice.error
        tokens = choice.token_ids
        cut = tokens.index(close)
        assert cut <= 2 and re.fullmatch("[ab]{3}", tok.decode(tokens[cut + 1 : -1])) and tokens[-1] == eos


def test_engine_fails_only_the_blocked_choice(core) -> None:
    vocab = core.manifest.tokenizer.vocab_size

    def block_first(seqs):
        allowed = torch.ones(len(seqs), vocab, dtype=torch.bool)
        allowed[[i for i, s in enumerate(seqs) if s.request.request_id == "blocked"]] = False
        return allowed

    engine = build_engine(core, EngineConfig(num_pages=64), mask_hook=block_first)
    requests = [EngineRequest(rid, (5, 6, 7), (GREEDY,), 4, ignore_eos=True) for rid in ("blocked", "free")]
    outputs = run_to_completion(engine, requests)
    assert outputs["blocked"][0].finish is FinishCause.ERROR and "output constraint" in outputs["blocked"][0].error
    assert outputs["free"][0].finish is FinishCause.LENGTH and len(outputs["free"][0].token_ids) == 4


def test_structured_answer_is_verbatim_once_it_begins(frontend) -> None:
    tok = frontend.tokenizer
    think, close, call = (tok.token_to_id(s) for s in ("<think>", "</think>", "<tool_call>"))
    # Special tokens release no text; this tokenizer's delimiters and tool opener are all special.
    answer = [
        Piece(10, '{"a": "', None),
        Piece(think, "", None),
        Piece(call, "", None),
        Piece(11, "</think>", None),
        Piece(12, '"}', None),
    ]
    for structured in (True, False):
        parser = build_parser(tok, "qwen3", "hermes", (1, 2), True, (), structured=structured)
        pieces = [Piece(think, "", None), Piece(9, "plan", None), Piece(close, "", None)] + answer
        try:
            events = [e for p in pieces for e in parser.feed(p)] + parser.finish(truncated=False)
        except ToolCallError:
            events = None  # without a constraint the opener inside the string starts a (broken) call
        if structured:
            assert events is not None
            assert "".join(e.text for e in events if isinstance(e, ReasoningEvent)) == "plan"
            assert "".join(e.text for e in events if isinstance(e, TextEvent)) == '{"a": "</think>"}'
            assert all(isinstance(e, (ReasoningEvent, TextEvent)) for e in events)
        else:
            assert events is None
