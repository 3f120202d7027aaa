"""Every recipe whose family ignition compiles, end to end on its tiny core: the recipe's chat
template renders the request, a scripted model writes reasoning and a tool call in the recipe's
own syntax, the recipe's parsers turn it into Chat Completions, Messages and Responses fields,
and the call's result goes back through each protocol's history into the next prompt.

Only the token choice is scripted (tests/server/scripted.py): templates, parsers, encoders and
HTTP are the production path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from scripted import ScriptedServer, scripted_app
from support import TinyCores

pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)

ASK = "Weather in Paris?"
RESULT = "Sunny, 21 C"
ANSWER = "It is sunny."
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
ARGUMENTS = {"city": "Paris", "days": 3}
VERSION = {"anthropic-version": "2023-06-01"}
THINK = "The user wants weather."

O, C, S = "<|open|>", "<|close|>", "<|sep|>"
KIMI3 = (
    f"{THINK}{C}think{S}{O}response{S}Checking.{C}response{S}{O}tools{S}"
    f'{O}call tool="get_weather" index="1"{S}{O}argument key="city" type="string"{S}Paris{C}argument{S}'
    f'{O}argument key="days" type="number"{S}3{C}argument{S}{C}call{S}{C}tools{S}{C}message{S}<|end_of_msg|>'
)
GEMMA4 = f'<|channel>thought\n{THINK}<channel|>Checking.<|tool_call>call:get_weather{{city:<|"|>Paris<|"|>,days:3}}<tool_call|>'
QWEN_CODER = (
    f"{THINK}\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


@dataclass(frozen=True)
class Case:
    family: str
    chat: str | None  # the test checkpoint's chat flavour (None: the family's own)
    output: str | None  # reasoning + "Checking." + a get_weather call in the recipe's syntax; None: no syntax
    final: str  # the answer after the tool result: reasoning "Done." then ANSWER, in the recipe's syntax
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # what turns the template's thinking on


DSML = "｜DSML｜"
DEEPSEEK = (
    f'{THINK}</think>Checking.\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>'
)

KIMI3_FINAL = f"Done.{C}think{S}{O}response{S}{ANSWER}{C}response{S}{C}message{S}<|end_of_msg|>"
QWEN_FINAL = f"Done.\n</think>\n\n{ANSWER}"
CASES = {
    "smollm2": Case("llama", None, None, ANSWER),
    "gemma3": Case("gemma3", None, None, ANSWER),
    "gemma4": Case(
        "gemma4", "gemma4", GEMMA4, f"<|channel>thought\nDone.<channel|>{ANSWER}", {"enable_thinking": True}
    ),
    "kimi3": Case("kimi_k3", None, KIMI3, KIMI3_FINAL),
    "kimi31": Case("kimi_k3", None, KIMI3, KIMI3_FINAL),
    "deepseek4": Case("deepseek_v4", None, DEEPSEEK, f"Done.</think>{ANSWER}"),
    "deepseek41": Case("deepseek_v4", None, DEEPSEEK, f"Done.</think>{ANSWER}"),
    "qwen38": Case("qwen3_next", "qwen3.5", QWEN_CODER, QWEN_FINAL),
    "qwen38_dense": Case("qwen3_next", "qwen3.5", QWEN_CODER, QWEN_FINAL),
    "nemotron_h": Case("nemotron_h", None, QWEN_CODER, QWEN_FINAL),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request: pytest.FixtureRequest, tiny_cores: TinyCores):
    """The recipe's tiny core (the same as test_reasoning_budget_families') served with a scripted model."""
    name = request.param
    case = CASES[name]
    _, core = tiny_cores(case.family, name, 4, chat=case.chat)
    with scripted_app(core) as app:
        yield case, app


def _first_turn(app: ScriptedServer, case: Case, path: str, body: dict[str, Any], **kwargs) -> dict[str, Any]:
    app.say(case.output or "Checking.")
    response = app.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    prompt = app.last_prompt()
    assert prompt is not None and ASK in prompt
    if case.output is not None:
        assert "get_weather" in prompt  # the template declared the tool
    return response.json()


def _second_turn(app: ScriptedServer, case: Case, path: str, body: dict[str, Any], **kwargs) -> dict[str, Any]:
    app.say(case.final)
    response = app.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    prompt = app.last_prompt()
    assert prompt is not None and RESULT in prompt and "Paris" in prompt  # the call and its result, rendered
    return response.json()


def test_chat_completions(served) -> None:
    case, app = served
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}] if case.output else []
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": ASK}],
        "max_tokens": 256,
        **({"tools": tools} if tools else {}),
        "chat_template_kwargs": case.template_kwargs,
    }
    choice = _first_turn(app, case, "/v1/chat/completions", body)["choices"][0]
    message = choice["message"]
    if case.output is None:
        assert message["content"] == "Checking." and choice["finish_reason"] == "stop"
        return
    assert message["reasoning_content"].strip() == THINK and message["content"].strip() == "Checking."
    assert choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS
    history = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": message["content"],
            "reasoning_content": message["reasoning_content"],
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
    ]
    final = _second_turn(app, case, "/v1/chat/completions", {**body, "messages": history})["choices"][0]
    assert final["message"]["reasoning_content"].strip() == "Done." and final["message"]["content"].strip() == ANSWER
    assert final["finish_reason"] == "stop"


def test_anthropic_messages(served) -> None:
    case, app = served
    tools = [{"name": "get_weather", "input_schema": CITY}] if case.output else []
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if case.output else {}
    body = {
        "model": "x",
        "max_tokens": 256,
        "messages": [{"role": "user", "content": ASK}],
        **({"tools": tools} if tools else {}),
        **thinking,
    }
    message = _first_turn(app, case, "/v1/messages", body, headers=VERSION)
    kinds = [block["type"] for block in message["content"]]
    if case.output is None:
        assert kinds == ["text"] and message["content"][0]["text"] == "Checking."
        return
    assert kinds == ["thinking", "text", "tool_use"] and message["stop_reason"] == "tool_use"
    thought, text, use = message["content"]
    assert thought["thinking"].strip() == THINK and text["text"].strip() == "Checking."
    assert use["name"] == "get_weather" and use["input"] == ARGUMENTS
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": message["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": RESULT}]},
    ]
    final = _second_turn(app, case, "/v1/messages", {**body, "messages": history}, headers=VERSION)
    assert [b["type"] for b in final["content"]] == ["thinking", "text"] and final["stop_reason"] == "end_turn"
    assert final["content"][0]["thinking"].strip() == "Done." and final["content"][1]["text"].strip() == ANSWER


def test_responses(served) -> None:
    case, app = served
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}] if case.output else []
    body = {
        "model": "x",
        "input": ASK,
        "max_output_tokens": 256,
        **({"tools": tools} if tools else {}),
        "chat_template_kwargs": case.template_kwargs,
    }
    response = _first_turn(app, case, "/v1/responses", body)
    items = response["output"]
    if case.output is None:
        assert [i["type"] for i in items] == ["message"] and items[0]["content"][0]["text"] == "Checking."
        return
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    reasoning, text, call = items
    assert reasoning["content"][0]["text"].strip() == THINK and text["content"][0]["text"].strip() == "Checking."
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == ARGUMENTS
    history = [
        {"role": "user", "content": ASK},
        reasoning,
        text,
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT},
    ]
    final = _second_turn(app, case, "/v1/responses", {**body, "input": history})["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"] and final[0]["content"][0]["text"].strip() == "Done."
    assert final[1]["content"][0]["text"].strip() == ANSWER
