"""thinking_token_budget on every recipe family's tiny core (spec: "thinking_token_budget"): the
prepared syntax decides. Output that starts in reasoning is cut at the family's single-token
close (the engine forces it; the family's own parser reads it as the end of reasoning), output
that starts in content is accepted without a cut, and a start in reasoning without a single-token
close (Kimi K3) is a 400 naming thinking_token_budget. The [server] default needs a default
output start it can cut. Kimi K3's recipe default effort reaches its template.

One core per recipe family, from the family's test checkpoint with its real recipe (kimi31,
deepseek4 and qwen38_dense share their family's template, encoder and syntax), through the
tiny_cores fixture: the recipe round trips and the engine's hybrid-state tests export the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
from support import ScriptedExecutor, TinyCores

from helios.config import ConfigError, ServerConfig
from helios.core import Core
from helios.core.template import ChatTemplate
from helios.engine import EngineConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineEvent, FinishCause
from helios.frontend.detokenizer import TokenBytes
from helios.frontend.events import ReasoningEvent, TextEvent
from helios.frontend.inference import Conversation, InferenceRequest, LogprobOptions, RequestError, StopOptions
from helios.frontend.output import ChoiceOutput
from helios.frontend.parsers import build_parser
from helios.frontend.prepare import default_budget_problem
from helios.frontend.request import Frontend
from helios.protocols import openai_chat
from helios.server.state import build_state

CUT, CONTENT, REFUSED = "cut", "content", "refused"
BUDGET = 3
THOUGHT = " one two three four five six"  # more reasoning tokens than the budget
ANSWER = "Fine."


@dataclass(frozen=True)
class Family:
    family: str  # ignition test checkpoint family
    chat: str | None  # its chat flavour (None: the family's own)
    close: str | None  # the close delimiter a cut forces
    cases: tuple[tuple[dict[str, Any], str], ...]  # (chat_template_kwargs, expected)
    default_problem: str | None  # what the [server] default's startup check says (None: accepted)


FAMILIES = {
    "smollm2": Family("llama", None, None, (({}, REFUSED),), "no reasoning syntax"),
    "gemma3": Family("gemma3", None, None, (({}, REFUSED),), "no reasoning syntax"),
    # Gemma 4's prompt never opens the thought channel: with thinking off it is closed in the
    # prompt, with thinking on the model opens it.
    "gemma4": Family(
        "gemma4", "gemma4", "<channel|>", (({}, CONTENT), ({"enable_thinking": True}, CONTENT)), "in content"
    ),
    # Kimi K3 opens <|open|>think<|sep|>; its close is three tokens.
    "kimi3": Family("kimi_k3", None, None, (({}, REFUSED), ({"thinking": False}, CONTENT)), "single-token"),
    # Native encoder: <think> opens reasoning unless thinking is off.
    "deepseek41": Family("deepseek_v4", None, "</think>", (({}, CUT), ({"thinking": False}, CONTENT)), None),
    "qwen38": Family("qwen3_next", "qwen3.5", "</think>", (({}, CUT), ({"enable_thinking": False}, CONTENT)), None),
    "nemotron_h": Family("nemotron_h", None, "</think>", (({}, CUT), ({"enable_thinking": False}, CONTENT)), None),
    "glm53": Family("glm5_next", None, "</think>", (({}, CUT), ({"reasoning_effort": "none"}, CONTENT)), None),
    "mimo_v2": Family("mimo_v2", None, "</think>", (({}, CONTENT), ({"enable_thinking": True}, CUT)), "in content"),
    "minimax_m3": Family(
        "minimax_m3",
        None,
        "</mm:think>",
        (({}, CONTENT), ({"thinking_mode": "enabled"}, CUT), ({"thinking_mode": "disabled"}, CONTENT)),
        "in content",
    ),
    "muse_spark": Family("muse_spark", None, "</think>", (({}, CONTENT),), "in content"),
    "step5": Family("step5", None, "</think>", (({}, CUT),), None),
}


pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)


def _served(tiny_cores: TinyCores, name: str) -> tuple[Family, Core]:
    family = FAMILIES[name]
    _, out = tiny_cores(family.family, name, 4, chat=family.chat)
    return family, Core.open(out, verify_checksums=False)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest, tiny_cores: TinyCores) -> tuple[Family, Core]:
    return _served(tiny_cores, request.param)


def _chat(kwargs: dict[str, Any], **fields: Any) -> InferenceRequest:
    body = {"model": "x", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 32}
    return openai_chat.decode({**body, "chat_template_kwargs": kwargs, **fields})[0]


def test_the_budget_follows_the_prepared_syntax(served: tuple[Family, Core]) -> None:
    family, core = served
    frontend = Frontend(core, ServerConfig())
    for kwargs, expected in family.cases:
        request = _chat(kwargs, thinking_token_budget=BUDGET)
        if expected == REFUSED:
            with pytest.raises(RequestError) as refused:
                frontend.prepare(request, "r")
            assert refused.value.param == "thinking_token_budget" and "thinking_token_budget" in refused.value.message
            continue
        engine = frontend.prepare(request, "r").inputs[0].engine
        assert engine is not None
        if expected == CONTENT:
            assert engine.reasoning_budget is None, kwargs  # accepted without a cut
            continue
        budget = engine.reasoning_budget
        assert budget is not None, kwargs
        assert (budget.budget, budget.close_id) == (BUDGET, frontend.tokenizer.token_to_id(family.close))


def test_the_cut_ends_reasoning_in_the_familys_parser(served: tuple[Family, Core]) -> None:
    """The engine forces the close at the budget; the family's output parser reads the reasoning
    before it and the answer after it."""
    family, core = served
    cases = [kwargs for kwargs, expected in family.cases if expected == CUT]
    if not cases:
        pytest.skip(f"{core.manifest.recipe.name}: no output start here is cut")
    frontend = Frontend(core, ServerConfig())
    tokenizer = frontend.tokenizer
    request = frontend.prepare(_chat(cases[0], thinking_token_budget=BUDGET), "r").inputs[0].engine
    assert request is not None
    eos = core.manifest.tokenizer.eos_token_ids[0]
    engine = build_engine(core, EngineConfig(num_pages=64))
    scripted = ScriptedExecutor(engine.executor, eos_id=eos)
    thought = tokenizer.encode(THOUGHT, add_special_tokens=False).ids
    # Position BUDGET is the forced close; the script's token there is never drawn.
    scripted.script([*thought[:BUDGET], thought[BUDGET], *tokenizer.encode(ANSWER, add_special_tokens=False).ids])
    engine.executor = scripted
    (choice,) = run_to_completion(engine, [replace(request, params=request.params[:1])])[request.request_id]
    assert choice.finish is FinishCause.EOS, choice.error
    assert choice.token_ids[BUDGET] == request.reasoning_budget.close_id  # type: ignore[union-attr]
    assert engine.stats.reasoning_budget_cuts == 1
    output = ChoiceOutput(TokenBytes(tokenizer), StopOptions(), LogprobOptions(), frozenset((eos,)))
    delta = output.push(EngineEvent("r", 0, tuple(choice.token_ids), None, FinishCause.EOS))
    recipe = core.manifest.recipe
    parser = build_parser(tokenizer, recipe.reasoning_syntax, recipe.tool_syntax, request.prompt_ids, False)
    events = [e for piece in delta.pieces for e in parser.feed(piece)] + parser.finish(truncated=False)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningEvent))
    assert reasoning.strip() == tokenizer.decode(thought[:BUDGET]).strip()
    assert "".join(e.text for e in events if isinstance(e, TextEvent)).strip() == ANSWER


def test_the_server_default_needs_a_default_output_start_it_cuts(served: tuple[Family, Core]) -> None:
    """Startup refuses [server] thinking_token_budget, before building the engine, unless a plain
    chat's output starts in reasoning with a single-token close: single-token delimiters alone
    (MiMo, MiniMax, Muse Spark) are not enough when the default prompt starts in content."""
    family, core = served
    problem = default_budget_problem(Frontend(core, ServerConfig()))
    if family.default_problem is None:
        assert problem is None
    else:
        assert problem is not None and family.default_problem in problem
        with pytest.raises(ConfigError, match=f"thinking_token_budget .*{family.default_problem}"):
            build_state(core.root, ServerConfig(thinking_token_budget=100))


def test_kimi_k3_default_effort_reaches_its_template(tiny_cores: TinyCores) -> None:
    _, core = _served(tiny_cores, "kimi3")
    frontend = Frontend(core, ServerConfig())
    assert core.manifest.recipe.default_effort == "max"
    # The template's own fallback is replaced, so only the recipe's default can write "max".
    assert frontend.template is not None
    source = frontend.template.source.replace("set thinking_effort = 'max'", "set thinking_effort = 'low'")
    assert source != frontend.template.source
    frontend.template = ChatTemplate(source, frontend.template.special_tokens)
    chat = _chat({}).input
    assert isinstance(chat, Conversation)
    assert "thinking_effort=max" in frontend.render(chat)
    # A named effort reaches the variable the template reads; explicit template kwargs win.
    assert "thinking_effort=high" in frontend.render(replace(chat, effort="high"))
    assert "thinking_effort=low" in frontend.render(
        replace(chat, effort="high", template_kwargs={"thinking_effort": "low"})
    )
