"""Tool choice through Messages and Responses, buffered and streamed (harness: messages_responses.py)."""

from __future__ import annotations

from messages_responses import (
    CALL,
    TIME_CALL,
    WEATHER_CALL,
    api,  # noqa: F401 - fixture
    app,  # noqa: F401 - fixture
    both,
    call,
    failed,
    schemas,  # noqa: F401 - fixture
    tokens,
)

from helios.frontend.request import REQUIRED_TOOL_INSTRUCTION


# ---------------------------------------------------------------------------- tool_choice auto
def test_auto_reasoning_then_tool_call(api) -> None:
    script = "<think>The user wants weather.</think>" + CALL
    result = both(api, script, tools=api.tools("get_weather"), **api.choice("auto"))
    assert result.blocks == [("reasoning", "The user wants weather."), ("call", *WEATHER_CALL)]
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")
    assert result.output_tokens == tokens(api.app, script) + 1  # reasoning and the call, plus EOS
    if api.name == "responses":
        assert result.body["tool_choice"] == "auto" and result.body["parallel_tool_calls"] is True
        assert 0 < result.reasoning_tokens < result.output_tokens
    assert "get_weather" in api.app.last_prompt()


def test_auto_returns_undeclared_tools_as_generated(api) -> None:
    result = both(api, call("undeclared", {"x": 1}), tools=api.tools("get_weather"))
    assert result.blocks == [("call", "undeclared", {"x": 1})]
    assert result.reasoning_tokens in (None, 0)  # no reasoning, none counted
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")


def test_auto_parallel_calls(api) -> None:
    result = both(api, "Both." + CALL + "\n" + TIME_CALL, tools=api.tools("get_weather", "get_time"))
    assert result.blocks == [("text", "Both."), ("call", *WEATHER_CALL), ("call", "get_time", {})]


def test_auto_truncated_call_reports_the_limit(api) -> None:
    limit = {"max_tokens": 5} if api.name == "messages" else {"max_output_tokens": 5}
    result = both(api, CALL, tools=api.tools("get_weather"), **limit)
    assert result.calls == [] and result.output_tokens == 5
    assert result.stop == ("max_tokens" if api.name == "messages" else "incomplete")
    if api.name == "responses":
        assert result.body["incomplete_details"] == {"reason": "max_output_tokens"}


# ---------------------------------------------------------------------------- tool_choice none
def test_none_presents_no_tools_and_parses_no_calls(api) -> None:
    result = both(api, "<think>No tools.</think>" + CALL, tools=api.tools("get_weather"), **api.choice("none"))
    assert "get_weather" not in api.app.last_prompt() and "<tools>" not in api.app.last_prompt()
    assert result.calls == [] and result.reasoning == "No tools."
    assert "get_weather" in result.text  # the call syntax stays ordinary answer text
    assert result.stop == ("end_turn" if api.name == "messages" else "completed")


# ---------------------------------------------------------------------------- required
def test_required_without_a_call_fails(api) -> None:
    result = both(api, "No tools needed.", tools=api.tools("get_weather"), **api.choice("required"))
    failed(api, result, "requires a tool call")
    assert REQUIRED_TOOL_INSTRUCTION in api.app.last_prompt()


def test_required_with_a_truncated_call_fails(api) -> None:
    limit = {"max_tokens": 5} if api.name == "messages" else {"max_output_tokens": 5}
    result = both(api, CALL, tools=api.tools("get_weather"), **api.choice("required"), **limit)
    failed(api, result, "requires a tool call")


def test_required_only_undeclared_calls_fails(api) -> None:
    result = both(api, call("undeclared", {}), tools=api.tools("get_weather"), **api.choice("required"))
    failed(api, result, "requires a tool call")


def test_required_with_a_call(api) -> None:
    result = both(api, "<think>Call it.</think>" + CALL, tools=api.tools("get_weather"), **api.choice("required"))
    assert result.blocks == [("reasoning", "Call it."), ("call", *WEATHER_CALL)]
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")
    assert REQUIRED_TOOL_INSTRUCTION in api.app.last_prompt()
    if api.name == "responses":
        assert result.body["tool_choice"] == "required"


def test_required_needs_a_declared_tool(api) -> None:
    response = api.post(api.choice("required"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- named
def test_named_presents_only_the_selected_tool_and_hides_answer_text(api) -> None:
    script = "<think>Weather tool.</think>Sure, calling it." + CALL
    result = both(api, script, tools=api.tools("get_weather", "get_time"), **api.choice("named", "get_weather"))
    prompt = api.app.last_prompt()
    assert '"name": "get_weather"' in prompt and "get_time" not in prompt
    assert result.blocks == [("reasoning", "Weather tool."), ("call", *WEATHER_CALL)]  # no answer text
    assert result.output_tokens == tokens(api.app, script) + 1  # usage counts the omitted text
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")
    if api.name == "messages":  # no text block was ever opened in the stream either
        starts = [d["content_block"]["type"] for n, d in result.streamed.events if n == "content_block_start"]
        assert starts == ["thinking", "tool_use"]
    else:
        added = [d["item"]["type"] for _, d in result.streamed.events if d["type"] == "response.output_item.added"]
        assert added == ["reasoning", "function_call"]
        assert result.body["tool_choice"] == {"type": "function", "name": "get_weather"}


def test_named_call_to_another_tool_fails(api) -> None:
    result = both(api, CALL, tools=api.tools("get_weather", "get_time"), **api.choice("named", "get_time"))
    failed(api, result, "get_time", "get_weather")


def test_named_without_a_call_fails(api) -> None:
    result = both(api, "Just text.", tools=api.tools("get_weather", "get_time"), **api.choice("named", "get_time"))
    failed(api, result, "requires a tool call")


def test_named_must_be_declared(api) -> None:
    response = api.post({"tools": api.tools("get_weather"), **api.choice("named", "get_time")})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- parallel calls off
def test_parallel_off_fails_on_the_second_call(api) -> None:
    body = {"tools": api.tools("get_weather", "get_time"), **api.choice("auto", parallel=False)}
    result = both(api, CALL + "\n" + TIME_CALL, **body)
    failed(api, result, "parallel_tool_calls")
    events = result.streamed.events  # the stream may already have delivered the first call, never the second
    if api.name == "messages":
        names = [
            d["content_block"]["name"]
            for n, d in events
            if n == "content_block_start" and d["content_block"]["type"] == "tool_use"
        ]
    else:
        names = [
            d["item"]["name"]
            for _, d in events
            if d["type"] == "response.output_item.added" and d["item"]["type"] == "function_call"
        ]
    assert "get_time" not in names


def test_parallel_off_with_one_call(api) -> None:
    result = both(api, CALL, tools=api.tools("get_weather"), **api.choice("required", parallel=False))
    assert result.blocks == [("call", *WEATHER_CALL)]
    if api.name == "responses":
        assert result.body["parallel_tool_calls"] is False
