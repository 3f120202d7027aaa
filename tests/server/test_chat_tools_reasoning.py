"""Reasoning and tool calls through Chat Completions, with a scripted model on a real stack."""

from __future__ import annotations

import json

import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(app, **body):
    return app.post("/v1/chat/completions", json={"model": "x", "messages": ASK, "max_tokens": 256, **body})


def test_reasoning_then_tool_call_buffered(qwen3_app) -> None:
    qwen3_app.say("<think>The user wants weather.</think>" + CALL)
    body = _chat(qwen3_app, tools=[WEATHER]).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    call = message["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_reasoning_text_and_tool_call_streamed(qwen3_app) -> None:
    qwen3_app.say("<think>Plan.</think>Checking." + CALL)
    response = _chat(qwen3_app, tools=[WEATHER], stream=True)
    chunks = [
        json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:") and "[DONE]" not in line
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Plan."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_token_stop_after_a_tool_call_reports_stop(qwen3_app) -> None:
    """An explicit token stop is the user's stop: finish_reason stop, not tool_calls, even when a
    parsed call completed the answer (api.md: parsed calls complete an answer the user did not stop)."""
    tokenizer = qwen3_app.state.frontend.tokenizer
    for tail in ("!", "~", "#", "%", "^", "Q", "X", "Z"):  # a token that only comes after the call
        ids = tokenizer.encode(CALL + tail, add_special_tokens=False).ids
        if ids[-1] not in ids[:-1]:
            break
    else:
        pytest.fail("no stop token that only follows the call in this tokenizer")
    qwen3_app.say(CALL + tail)
    response = _chat(qwen3_app, tools=[WEATHER], stop_token_ids=[ids[-1]])
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "stop"
    qwen3_app.say(CALL)
    assert _chat(qwen3_app, tools=[WEATHER]).json()["choices"][0]["finish_reason"] == "tool_calls"  # end of sequence


def test_delimiter_spelled_in_text_stays_text(qwen3_app) -> None:
    # "<think>" written by the model as ordinary characters is answer text, not a delimiter.
    qwen3_app.say("Use a tag like <", "think> in templates.")
    body = _chat(qwen3_app).json()
    assert "reasoning_content" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_policies(qwen3_app) -> None:
    qwen3_app.say("No tools needed.")
    response = _chat(qwen3_app, tools=[WEATHER], tool_choice="required")
    assert response.status_code == 500 and "requires a tool call" in response.json()["error"]["message"]
    qwen3_app.say(CALL)
    named = _chat(qwen3_app, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.status_code == 500 and "get_time" in named.json()["error"]["message"]
    qwen3_app.say(CALL + CALL)
    single = _chat(qwen3_app, tools=[WEATHER], parallel_tool_calls=False)
    assert single.status_code == 500 and "parallel_tool_calls" in single.json()["error"]["message"]
    qwen3_app.say('<tool_call>{"name": "undeclared", "arguments": {}}</tool_call>')
    auto = _chat(qwen3_app, tools=[WEATHER]).json()
    assert auto["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "undeclared"


def test_named_tool_choice_hides_answer_text(qwen3_app) -> None:
    qwen3_app.say("Sure, calling it." + CALL)
    body = _chat(
        qwen3_app, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ).json()
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_truncated_tool_call_reports_length(qwen3_app) -> None:
    qwen3_app.say(CALL)
    body = _chat(qwen3_app, tools=[WEATHER], max_tokens=5).json()
    assert body["choices"][0]["finish_reason"] == "length" and "tool_calls" not in body["choices"][0]["message"]


def test_history_with_tool_results_renders(qwen3_app) -> None:
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    qwen3_app.say("It is sunny.")
    body = qwen3_app.post(
        "/v1/chat/completions", json={"model": "x", "messages": messages, "tools": [WEATHER, TIME], "max_tokens": 64}
    ).json()
    assert body["choices"][0]["message"]["content"] == "It is sunny."
    prompt = qwen3_app.state.frontend.render  # results are normalized to call order before rendering
    from helios.protocols.openai_chat import decode

    request, _ = decode({"model": "x", "messages": messages, "tools": [WEATHER, TIME]})
    text = prompt(request.input)
    assert text.index("sunny") < text.index("noon")


def test_thinking_budget_forces_the_close_token(qwen3_app) -> None:
    # The assistant turn is continued from "<think>\n", so output starts inside reasoning.
    messages = ASK + [{"role": "assistant", "content": "<think>\n"}]
    qwen3_app.say("one two three four five six seven</think>Final answer.")
    cuts = qwen3_app.state.client.engine.stats.reasoning_budget_cuts
    body = qwen3_app.post(
        "/v1/chat/completions",
        json={
            "model": "x",
            "messages": messages,
            "max_tokens": 64,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "thinking_token_budget": 3,
            "logprobs": True,
        },
    ).json()
    choice = body["choices"][0]
    tokenizer = qwen3_app.state.frontend.tokenizer
    reasoning_ids = tokenizer.encode(choice["message"]["reasoning_content"], add_special_tokens=False).ids
    assert len(reasoning_ids) == 3  # cut at the budget
    assert qwen3_app.state.client.engine.stats.reasoning_budget_cuts == cuts + 1
    # The forced </think> counts as generated but has no logprob entry.
    assert len(choice["logprobs"]["content"]) == body["usage"]["completion_tokens"] - 1 - 1  # minus EOS, minus forced
    unsupported = _chat(qwen3_app, thinking_token_budget=0)
    error = unsupported.json()["error"]
    assert unsupported.status_code == 400 and error["param"] is None and "thinking_token_budget" in error["message"]
