"""Reasoning budgets and effort through Messages and Responses, buffered and streamed
(harness: messages_responses.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from messages_responses import (
    API,
    ASK,
    CALL,
    WEATHER_CALL,
    Messages,
    Responses,
    Schemas,
    app,  # noqa: F401 - fixture
    both,
    schemas,  # noqa: F401 - fixture
    tokens,
)
from scripted import ScriptedServer, scripted_app

from helios.core.template import ChatTemplate

# ---------------------------------------------------------------------------- reasoning budgets
THINK_OPEN = "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}"
EFFORT_LINE = (
    "{%- if reasoning_effort is defined %}"
    "{{- '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}\n"
)
REASONING = "one two three four five six seven"


@contextmanager
def thinking_template(app: ScriptedServer) -> Iterator[None]:
    """A Qwen3-Thinking-style variant of the core's template: its generation prompt opens
    reasoning ("<think>\\n", so output starts inside reasoning and a budget can cut it) unless
    thinking is disabled, and it states the reasoning effort it is given."""
    frontend = app.state.frontend
    original = frontend.template
    source = original.source.replace(
        THINK_OPEN,
        THINK_OPEN.replace("    {%- endif %}", "    {%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}"),
    )
    assert source != original.source
    frontend.template = ChatTemplate(EFFORT_LINE + source, original.special_tokens)
    try:
        yield
    finally:
        frontend.template = original


def cuts(app: ScriptedServer) -> int:
    metrics = app.get("/metrics", params={"format": "json"}).json()
    assert metrics["reasoning_budget_cuts"] == app.state.client.engine.stats.reasoning_budget_cuts
    return metrics["reasoning_budget_cuts"]


def budget_fields(api, kind: str, budget: int) -> dict[str, Any]:
    if kind == "budget_tokens":
        return {"thinking": {"type": "enabled", "budget_tokens": budget}}
    if kind == "both":
        return {"thinking": {"type": "enabled", "budget_tokens": budget}, "thinking_token_budget": budget}
    return {"thinking_token_budget": budget}


BUDGET_CASES = [
    ("messages", "budget_tokens"),
    ("messages", "thinking_token_budget"),
    ("messages", "both"),
    ("responses", "thinking_token_budget"),
]


# The forced close takes the place of the scripted model's fourth token ("w"): 3 reasoning
# tokens ("on", "e", " t"), the close, then the answer.
CUT = ("one t", "w", "Final answer.")


@pytest.mark.parametrize(("protocol", "kind"), BUDGET_CASES)
def test_budget_forces_the_close_token(protocol: str, kind: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    assert tokens(app, CUT[0]) == 3
    with thinking_template(app):
        before = cuts(app)
        result = both(api, CUT, **budget_fields(api, kind, 3))
        assert app.last_prompt().endswith("<|im_start|>assistant\n<think>\n")
        assert cuts(app) == before + 2  # buffered and streamed
        assert result.blocks == [("reasoning", "one t"), ("text", "Final answer.")]
        assert result.stop == ("end_turn" if api.name == "messages" else "completed")
        # The forced close is a generated token (it replaced the fourth scripted token), and usage counts it.
        assert result.output_tokens == tokens(app, "".join(CUT)) + 1  # plus EOS
        if api.name == "responses":  # the reasoning region: its 3 tokens and the close delimiter
            assert 3 <= result.reasoning_tokens <= 4
        # The forced close counts within the output limit: 3 reasoning + close + 1 answer token.
        limit = {"max_tokens": 5} if api.name == "messages" else {"max_output_tokens": 5}
        limited = both(api, CUT, **budget_fields(api, kind, 3), **limit)
        assert cuts(app) == before + 4
        assert limited.blocks == [("reasoning", "one t"), ("text", "F")] and limited.output_tokens == 5
        assert limited.stop == ("max_tokens" if api.name == "messages" else "incomplete")


def test_budget_close_has_no_logprob_entry(app: ScriptedServer, schemas: Schemas) -> None:
    api = Responses(app, schemas)
    with thinking_template(app):
        app.say(*CUT)
        result = api.buffered(
            {"thinking_token_budget": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
        )
    entries = result.body["output"][-1]["content"][0]["logprobs"]
    assert [e["token"] for e in entries] == ["F", "in", "a", "l", " a", "n", "s", "w", "er", "."]
    assert "".join(e["token"] for e in entries) == result.text == "Final answer."


@pytest.mark.parametrize("protocol", sorted(API))
def test_budget_without_a_cut(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    script = "<think>" + REASONING + "</think>Answer."
    before = cuts(app)
    # The core's own template starts output in content: the budget is accepted without a cut.
    result = both(api, script, thinking_token_budget=3)
    assert result.reasoning == REASONING and result.text == "Answer." and cuts(app) == before
    with thinking_template(app):
        # A budget larger than the reasoning never cuts.
        result = both(api, REASONING + "</think>Answer.", thinking_token_budget=50)
        assert result.reasoning == REASONING and result.text == "Answer." and cuts(app) == before
        if api.name == "messages":
            # Disabled thinking closes reasoning in the prompt; Messages budgets above the 32-bit
            # limit are accepted and never cut.
            disabled = both(api, "Answer.", thinking={"type": "disabled"}, thinking_token_budget=3)
            assert app.last_prompt().endswith("<think>\n\n</think>\n\n") and disabled.text == "Answer."
            huge = both(api, REASONING + "</think>Answer.", thinking={"type": "enabled", "budget_tokens": 1 << 31})
            assert huge.reasoning == REASONING and huge.text == "Answer." and cuts(app) == before
            adaptive = both(api, REASONING + "</think>Answer.", thinking={"type": "adaptive", "budget_tokens": 10**12})
            assert adaptive.reasoning == REASONING and cuts(app) == before


def test_huge_messages_budget_is_never_cut_by_the_server_default(app: ScriptedServer, schemas: Schemas) -> None:
    """A Messages budget above the 32-bit limit is an explicit budget that never cuts: the server's
    thinking_token_budget default, which caps a request that omits a budget, does not replace it."""
    api = Messages(app, schemas)
    frontend = app.state.frontend
    original = frontend.config
    frontend.config = dataclasses.replace(original, thinking_token_budget=3)
    try:
        with thinking_template(app):
            before = cuts(app)
            defaulted = both(api, CUT, thinking={"type": "adaptive"})
            assert defaulted.blocks == [("reasoning", "one t"), ("text", "Final answer.")]
            assert cuts(app) == before + 2  # buffered and streamed
            for thinking in (
                {"type": "enabled", "budget_tokens": 1 << 31},
                {"type": "adaptive", "budget_tokens": 10**12},
            ):
                huge = both(api, REASONING + "</think>Answer.", thinking=thinking)
                assert huge.reasoning == REASONING and huge.text == "Answer." and cuts(app) == before + 2
    finally:
        frontend.config = original


@pytest.mark.parametrize("protocol", sorted(API))
def test_budget_after_a_tool_call_ended_reasoning(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    """Qwen's <tool_call> ends reasoning implicitly: the budget has nothing left to close."""
    api = API[protocol](app, schemas)
    assert tokens(app, "ab") == 2
    with thinking_template(app):
        before = cuts(app)
        result = both(api, ("ab", CALL), tools=api.tools("get_weather"), thinking_token_budget=3)
        assert result.blocks == [("reasoning", "ab"), ("call", *WEATHER_CALL)] and cuts(app) == before


@pytest.mark.parametrize("protocol", sorted(API))
def test_budget_rejections(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    bad = [{"thinking_token_budget": 0}, {"thinking_token_budget": 1 << 31}, {"thinking_token_budget": "8"}]
    if api.name == "messages":
        bad += [
            {"thinking": {"type": "enabled", "budget_tokens": 2048}, "thinking_token_budget": 1024},
            {"thinking": {"type": "enabled"}},
            {"thinking": {"type": "enabled", "budget_tokens": 0}},
        ]
    for fields in bad:
        response = api.post(fields)
        assert response.status_code == 400, fields
        body = response.json()
        if api.name == "messages":
            schemas.anthropic_body("ErrorResponse", body)
            assert body["error"]["type"] == "invalid_request_error" and "budget" in body["error"]["message"]
        else:
            schemas.openai_body("ErrorResponse", body)
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["param"] is None and "thinking_token_budget" in body["error"]["message"]


# ---------------------------------------------------------------------------- effort
def rendered_effort(app: ScriptedServer) -> str | None:
    prompt = app.last_prompt()
    marker = "Reasoning effort: "
    return prompt.split(marker, 1)[1].split("<|im_end|>", 1)[0] if marker in prompt else None


EFFORT_CASES = [
    # (protocol, request fields, resolved level in the template's vocabulary: low / medium / high)
    ("responses", {"reasoning": {"effort": "low"}}, "low"),
    ("responses", {"reasoning": {"effort": "medium"}}, "medium"),
    ("responses", {"reasoning": {"effort": "high"}}, "high"),
    ("responses", {"reasoning": {"effort": "xhigh"}}, "high"),
    ("responses", {"reasoning": {"effort": "minimal"}}, "low"),
    ("responses", {}, None),
    ("messages", {"output_config": {"effort": "low"}}, "low"),
    ("messages", {"output_config": {"effort": "medium"}}, "medium"),
    ("messages", {"output_config": {"effort": "high"}}, "high"),
    ("messages", {"output_config": {"effort": "max"}}, "high"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 5000}}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 5001}}, "high"),
    ("messages", {"thinking": {"type": "adaptive", "budget_tokens": 20000}}, "high"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 20001}}, "high"),  # max, nearest in vocabulary
    ("messages", {"thinking_token_budget": 100}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 20000}, "output_config": {"effort": "low"}}, "low"),
    (
        "messages",
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "medium"}},
        "medium",
    ),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1 << 40}}, "high"),
    ("messages", {}, None),
]


@pytest.mark.parametrize(("protocol", "fields", "level"), EFFORT_CASES)
def test_effort_reaches_the_template(
    protocol: str, fields: dict[str, Any], level: str | None, app: ScriptedServer, schemas: Schemas
) -> None:
    api = API[protocol](app, schemas)
    with thinking_template(app):
        result = both(api, "Thought.</think>Answer.", **fields)
        assert rendered_effort(app) == level and result.text == "Answer."
    if api.name == "responses":  # the response echoes the effort as sent
        assert result.body["reasoning"]["effort"] == fields.get("reasoning", {}).get("effort")


@pytest.mark.parametrize("protocol", sorted(API))
def test_numeric_effort_is_rejected(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    param = "reasoning.effort" if api.name == "responses" else "output_config.effort"
    for value in (80, 80.0, "80", True, "extreme"):
        fields = {"reasoning": {"effort": value}} if api.name == "responses" else {"output_config": {"effort": value}}
        response = api.post(fields)
        assert response.status_code == 400, value
        body = response.json()
        if api.name == "messages":
            schemas.anthropic_body("ErrorResponse", body)
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert param in body["error"]["message"]
        else:
            schemas.openai_body("ErrorResponse", body)
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] is None
            assert param in body["error"]["message"]


def _chat_effort(app: ScriptedServer, **fields: Any) -> str | None:
    app.say("Thought.</think>Answer.")
    body = app.post(
        "/v1/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": ASK}], "max_tokens": 64, **fields},
    ).json()
    assert body["choices"][0]["message"]["content"] == "Answer."
    return rendered_effort(app)


def test_chat_effort_is_the_template_option(app: ScriptedServer) -> None:
    """Chat's reasoning_effort is the native template option: it reaches a Jinja template as
    sent (chat_template_kwargs wins), unlike the named Responses and Messages settings."""
    with thinking_template(app):
        assert _chat_effort(app) is None
        assert _chat_effort(app, chat_template_kwargs={"reasoning_effort": "medium"}) == "medium"
        assert _chat_effort(app, reasoning_effort="low") == "low"
        assert _chat_effort(app, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == "high"


# ---------------------------------------------------------------------------- a core without reasoning syntax
@pytest.fixture(scope="module")
def plain(tiny_core: Path) -> Iterator[ScriptedServer]:
    with scripted_app(tiny_core) as server:
        yield server


def test_budgets_without_reasoning_syntax(plain: ScriptedServer, schemas: Schemas) -> None:
    """thinking.budget_tokens is an advisory hint where no hard cap is possible; an explicit
    thinking_token_budget is a 400 naming it, on every protocol."""
    messages = Messages(plain, schemas)
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive", "budget_tokens": 30000}):
        result = both(messages, "Hello there.", thinking=thinking)
        assert result.blocks == [("text", "Hello there.")] and result.stop == "end_turn"
    for api in (messages, Responses(plain, schemas)):
        response = api.post({"thinking_token_budget": 1024})
        assert response.status_code == 400 and "thinking_token_budget" in response.text, response.text
    both_fields = messages.post({"thinking": {"type": "enabled", "budget_tokens": 1024}, "thinking_token_budget": 1024})
    assert both_fields.status_code == 400 and "thinking_token_budget" in both_fields.text
