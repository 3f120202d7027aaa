"""DeepSeek V4 / V4.1: the official deepseek-recipe state machine for reasoning and DSML calls."""

from __future__ import annotations

import deepseek_recipe as ds
from parser_cases import Tok, check, check_error, factory

from ignition.testmodel import CHATS, build_tokenizer

TOKENIZER = build_tokenizer(CHATS["deepseek"]["special_tokens"])
SPECIAL = ds.SpecialToken
ASSISTANT, THINK, CLOSE, DSML = (
    Tok(t.default_str()) for t in (SPECIAL.Assistant, SPECIAL.ThinkingStart, SPECIAL.ThinkingEnd, SPECIAL.Dsml)
)
THINKING = factory(TOKENIZER, "deepseek", "deepseek_dsml_v4", prompt=[ASSISTANT, THINK])
NO_THINKING = factory(TOKENIZER, "deepseek", "deepseek_dsml_v4", prompt=[ASSISTANT, CLOSE])


def block(*invokes: list, name: str = "tool_calls") -> list:
    return ["<", DSML, f"{name}>\n", *[s for invoke in invokes for s in invoke], "</", DSML, f"{name}>"]


def invoke(tool: str, *params: list, spaced: bool = False) -> list:
    gap = " " if spaced else ""
    return ["<", DSML, f'{gap}invoke name="{tool}">\n', *[s for p in params for s in p], "</", DSML, f"{gap}invoke>\n"]


def param(key: str, value: str, string: bool = True) -> list:
    kind = "true" if string else "false"
    return ["<", DSML, f'parameter name="{key}" string="{kind}">{value}</', DSML, "parameter>\n"]


WEATHER = invoke("get_weather", param("city", "Paris"), param("days", "3", string=False))


def test_reasoning_then_answer() -> None:
    check(
        THINKING,
        ["\nLet me think.", CLOSE, "The answer is 4."],
        [("reasoning", "Let me think."), ("text", "The answer is 4.")],
    )


def test_delimiter_spelled_in_pieces_is_matched_as_text() -> None:
    check(THINKING, ["Plan.</think>Done."], [("reasoning", "Plan."), ("text", "Done.")])


def test_answer_only_without_thinking() -> None:
    check(NO_THINKING, ["Hello there."], [("text", "Hello there.")])


def test_one_call_after_reasoning_and_text() -> None:
    check(
        THINKING,
        ["Need weather.", CLOSE, "Checking.\n\n", *block(WEATHER)],
        [("reasoning", "Need weather."), ("text", "Checking."), ("call", "get_weather", {"city": "Paris", "days": 3})],
    )


def test_two_calls_and_the_v41_spelling() -> None:
    second = invoke("get_weather", param("city", "Rome"))
    expected = [
        ("reasoning", "Two cities."),
        ("call", "get_weather", {"city": "Paris", "days": 3}),
        ("call", "get_weather", {"city": "Rome"}),
    ]
    check(THINKING, ["Two cities.", CLOSE, *block(WEATHER, second)], expected)
    spaced = [
        invoke("get_weather", param("city", "Paris"), param("days", "3", string=False), spaced=True),
        invoke("get_weather", param("city", "Rome"), spaced=True),
    ]
    check(THINKING, ["Two cities.", CLOSE, *block(*spaced, name=" calls")], expected)


def test_json_parameters_keep_their_types() -> None:
    flags = invoke(
        "set_flags",
        param("on", "true", False),
        param("ratio", "0.5", False),
        param("note", "null", False),
        param("tags", "[1, 2]", False),
        param("opts", '{"k": "v}"}', False),
        param("raw", "false"),
    )
    check(
        NO_THINKING,
        block(flags),
        [
            (
                "call",
                "set_flags",
                {"on": True, "ratio": 0.5, "note": None, "tags": [1, 2], "opts": {"k": "v}"}, "raw": "false"},
            )
        ],
    )


def test_empty_arguments() -> None:
    check(NO_THINKING, block(invoke("get_time")), [("call", "get_time", {})])


def test_text_after_the_calls_block_is_discarded() -> None:
    check(
        THINKING,
        ["Go.", CLOSE, *block(WEATHER), "\nDone! <think>x</think>"],
        [("reasoning", "Go."), ("call", "get_weather", {"city": "Paris", "days": 3})],
    )


def test_invalid_json_parameter_fails() -> None:
    check_error(NO_THINKING, block(invoke("set_flags", param("tags", "[1, oops", False))), "not valid JSON")


def test_duplicate_argument_names_fail() -> None:
    check_error(NO_THINKING, block(invoke("get_weather", param("city", "A"), param("city", "B"))), "repeats argument")


def test_empty_names_fail() -> None:
    check_error(NO_THINKING, block(invoke("get_weather", param("", "A"))), "nonempty name")
    check_error(NO_THINKING, block(invoke("", param("city", "A"))), "nonempty name")


def test_truncated_call_is_omitted() -> None:
    partial = ["<", DSML, "tool_calls>\n<", DSML, 'invoke name="get_weather">\n', *param("city", "Paris")]
    check(
        THINKING,
        ["Plan.", CLOSE, "Ok.", *partial],
        [("reasoning", "Plan."), ("text", "Ok.")],
        truncated=True,
    )


def test_incomplete_call_at_natural_stop_fails() -> None:
    partial = ["<", DSML, "tool_calls>\n<", DSML, 'invoke name="get_weather">\n', *param("city", "Paris")]
    check_error(THINKING, ["Plan.", CLOSE, *partial], "unfinished")


def test_required_choice_starts_inside_the_calls_block() -> None:
    required = factory(
        TOKENIZER, "deepseek", "deepseek_dsml_v4", prompt=[ASSISTANT, THINK, "\n\n<", DSML, "tool_calls>\n"]
    )
    check(
        required,
        [*WEATHER, "</", DSML, "tool_calls>"],
        [("call", "get_weather", {"city": "Paris", "days": 3})],
    )


def test_structured_answer_is_verbatim_once_it_begins() -> None:
    structured = factory(TOKENIZER, "deepseek", "deepseek_dsml_v4", prompt=[ASSISTANT, THINK], structured=True)
    answer = ['{"a": "<', DSML, 'tool_calls> </think> x", "b": 1}']
    check(
        structured,
        ["Plan.", CLOSE, *answer],
        [("reasoning", "Plan."), ("text", '{"a": "<tool_calls> </think> x", "b": 1}')],
    )
    check(structured, ["Plan.", CLOSE, "42"], [("reasoning", "Plan."), ("text", "42")])
