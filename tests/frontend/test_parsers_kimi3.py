"""Kimi K3: <|open|>think<|sep|> reasoning, response wrappers, and <|open|>tools<|sep|> calls."""

from __future__ import annotations

from parser_cases import Tok, check, check_error, factory

from ignition.testmodel import build_tokenizer

TOKENIZER = build_tokenizer(("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"))
O, C, S = Tok("<|open|>"), Tok("<|close|>"), Tok("<|sep|>")
KIMI = factory(TOKENIZER, "kimi3", "kimi3", prompt=[O, 'message role="assistant"', S, O, "think", S])
RESPONSE = [C, "think", S, O, "response", S]


def argument(key: str, kind: str, value: str) -> list:
    return [O, f'argument key="{key}" type="{kind}"', S, value, C, "argument", S]


def test_reasoning_and_response_wrappers() -> None:
    check(
        KIMI,
        ["Think.", *RESPONSE, "Hello!", C, "response", S, C, "message", S],
        [("reasoning", "Think."), ("text", "Hello!")],
    )


def test_calls_with_typed_arguments_and_json_blocks() -> None:
    calls = [
        O,
        "tools",
        S,
        O,
        'call tool="get_weather" index="1"',
        S,
        *argument("city", "string", "Paris"),
        *argument("days", "number", "3"),
        C,
        "call",
        S,
        O,
        'call tool="set_flags" index="2"',
        S,
        O,
        'json type="object"',
        S,
        '{"on": true}',
        C,
        "json",
        S,
        C,
        "call",
        S,
        C,
        "tools",
        S,
    ]
    check(
        KIMI,
        ["Plan.", *RESPONSE, "Checking.", C, "response", S, *calls],
        [
            ("reasoning", "Plan."),
            ("text", "Checking."),
            ("call", "get_weather", {"city": "Paris", "days": 3}),
            ("call", "set_flags", {"on": True}),
        ],
    )


def test_truncated_call_is_omitted() -> None:
    partial = [O, "tools", S, O, 'call tool="get_weather" index="1"', S, *argument("city", "string", "Paris")]
    check(
        KIMI,
        ["Plan.", *RESPONSE, "Ok.", C, "response", S, *partial],
        [("reasoning", "Plan."), ("text", "Ok.")],
        truncated=True,
    )
    check_error(KIMI, ["Plan.", *RESPONSE, *partial], "unfinished")
