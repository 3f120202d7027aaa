"""DeepSeek V4.1 end to end: the native encoder, reasoning and DSML calls on Chat, Messages and
Responses, buffered and streamed, with a scripted model on a real tiny core."""

from __future__ import annotations

import json
from typing import Any

import pytest
from scripted import scripted_app
from serving import sse_events

from tests.ignition.family_checks import ASK, CITY, DSML, DSML_CALL, VERSION, WEATHER_CALL

OUTPUT = "The user wants weather.</think>Checking.\n\n" + DSML_CALL + "ignored after the block"
EFFORT_LINE = "Reasoning Effort: {} (range 1-100"


@pytest.fixture(scope="module")
def app(deepseek_core):
    with scripted_app(deepseek_core) as server:
        yield server


# ---------------------------------------------------------------------------- Chat Completions
def _chat(app, stream: bool, **body) -> dict[str, Any]:
    full = {
        "model": "x",
        "messages": [{"role": "user", "content": ASK}],
        "max_tokens": 256,
        "stream": stream,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        **body,
    }
    response = app.post("/v1/chat/completions", json=full)
    assert response.status_code == 200, response.text
    if not stream:
        body = response.json()
        message, choice = body["choices"][0]["message"], body["choices"][0]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []
        ]
        reasoning_tokens = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
        return {
            "reasoning": message.get("reasoning_content"),
            "text": message["content"],
            "calls": calls,
            "finish": choice["finish_reason"],
            "reasoning_tokens": reasoning_tokens,
        }
    chunks = [json.loads(e) for e in sse_events(response) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict[int, list] = {}
    for call in (tc for d in deltas for tc in d.get("tool_calls") or []):
        entry = calls.setdefault(call["index"], [call["function"].get("name"), ""])
        entry[1] += call["function"].get("arguments") or ""
    finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    return {
        "reasoning": "".join(d.get("reasoning_content") or "" for d in deltas),
        "text": "".join(d.get("content") or "" for d in deltas),
        "calls": [(name, json.loads(arguments)) for name, arguments in calls.values()],
        "finish": finish,
    }


def test_chat_required_choice_starts_inside_the_calls_block(app) -> None:
    invoke = DSML_CALL.split("tool_calls>\n", 1)[1]  # the encoder's prompt already opened the block
    app.say(invoke)
    result = _chat(app, False, tool_choice="required")
    assert result["calls"] == WEATHER_CALL["calls"] and result["finish"] == "tool_calls"
    assert (app.last_prompt() or "").endswith(f"<｜Assistant｜><think>\n\n<{DSML} calls>\n")


def test_chat_numeric_effort(app) -> None:
    for body, score in (
        ({"reasoning_effort": 80}, 80),
        ({"chat_template_kwargs": {"reasoning_effort": 7}}, 7),
        ({"reasoning_effort": "max"}, 100),
        ({"reasoning_effort": None}, 75),
    ):
        app.say("Hmm.</think>Fine.")
        result = _chat(app, False, **body)
        assert (result["reasoning"], result["text"], result["finish"]) == ("Hmm.", "Fine.", "stop")
        assert EFFORT_LINE.format(score) in (app.last_prompt() or "")
    for value in (0, 101, "80", 80.0, True):
        response = app.post(
            "/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": ASK}], "reasoning_effort": value},
        )
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] is None and "reasoning_effort" in error["message"], error


def test_chat_rejects_controls_the_native_encoder_lacks(app) -> None:
    base = {"model": "x", "messages": [{"role": "user", "content": ASK}]}
    for extra, param in (
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"drop_thinking": True}}, "drop_thinking"),
        (
            {
                "messages": [{"role": "user", "content": ASK}, {"role": "assistant", "content": "It"}],
                "continue_final_message": True,
            },
            "continue_final_message",
        ),
    ):
        response = app.post("/v1/chat/completions", json={**base, **extra})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] is None and param in error["message"], error


# ---------------------------------------------------------------------------- Messages
def _messages(app, stream: bool, **body) -> dict[str, Any]:
    full = {
        "model": "x",
        "max_tokens": 256,
        "stream": stream,
        "messages": [{"role": "user", "content": ASK}],
        "tools": [{"name": "get_weather", "input_schema": CITY}],
        **body,
    }
    response = app.post("/v1/messages", json=full, headers=VERSION)
    assert response.status_code == 200, response.text
    if not stream:
        body = response.json()
        blocks = body["content"]
        stop = body["stop_reason"]
    else:
        events = [json.loads(e) for e in sse_events(response)]
        blocks = []
        for event in events:
            if event["type"] == "content_block_start":
                blocks.append(dict(event["content_block"], partial=""))
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                block = blocks[event["index"]]
                key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial"}.get(
                    delta["type"]
                )
                if key is not None:
                    block[key] += delta[{"partial": "partial_json"}.get(key, key)]
        for block in blocks:
            if block["type"] == "tool_use":
                block["input"] = json.loads(block["partial"])
        stop = next(e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta")
    return {
        "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
        "text": "".join(b["text"] for b in blocks if b["type"] == "text"),
        "calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
        "finish": stop,
    }


def test_messages_thinking_controls_reach_the_encoder(app) -> None:
    app.say("Hello.")
    result = _messages(app, False, thinking={"type": "disabled"})
    assert (result["text"], result["reasoning"]) == ("Hello.", "")
    assert (app.last_prompt() or "").endswith("<｜Assistant｜></think>")
    app.say("Brief.</think>Ok.")
    _messages(app, False, thinking={"type": "enabled", "budget_tokens": 3000})  # up to 5,000: low effort
    assert EFFORT_LINE.format(50) in (app.last_prompt() or "")


# ---------------------------------------------------------------------------- Responses
def _responses(app, stream: bool, **body) -> dict[str, Any]:
    full = {
        "model": "x",
        "input": ASK,
        "stream": stream,
        "max_output_tokens": 256,
        "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}],
        **body,
    }
    response = app.post("/v1/responses", json=full)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(e) for e in sse_events(response)]
        final = next(e["response"] for e in events if e["type"] in ("response.completed", "response.incomplete"))
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [item["id"] for item in done] == [item["id"] for item in final["output"]]
        output, status = done, final["status"]
    else:
        body = response.json()
        output, status = body["output"], body["status"]
    return {
        "reasoning": "".join(c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]),
        "text": "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"]),
        "calls": [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"],
        "finish": status,
    }


def test_responses_named_effort_resolves_against_the_encoder(app) -> None:
    for effort, score in (("max", 100), ("medium", 75), ("low", 50)):
        app.say("Fine.</think>Done.")
        assert _responses(app, False, reasoning={"effort": effort})["text"] == "Done."
        assert EFFORT_LINE.format(score) in (app.last_prompt() or "")


# ---------------------------------------------------------------------------- a DSML call on every route
# route -> (its reader, the finish reason, or the Responses status, of a turn that calls a tool)
CALL_TURNS = {
    "chat": (_chat, "tool_calls"),
    "messages": (_messages, "tool_use"),
    "responses": (_responses, "completed"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", sorted(CALL_TURNS))
def test_reasoning_and_dsml_call(app, route: str, stream: bool) -> None:
    read, finish = CALL_TURNS[route]
    app.say(OUTPUT)
    result = read(app, stream)
    assert {k: result[k] for k in WEATHER_CALL} == WEATHER_CALL and result["finish"] == finish
    if route == "chat" and not stream:
        assert result["reasoning_tokens"] == len(
            app.state.frontend.tokenizer.encode("The user wants weather.</think>").ids
        )
    prompt = app.last_prompt() or ""
    assert prompt.endswith("<｜User｜>Weather in Paris?<｜Assistant｜><think>") and EFFORT_LINE.format(75) in prompt
    assert '"name": "get_weather"' in prompt  # the encoder's own tool schema section
