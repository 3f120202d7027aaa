"""GLM 4.5-5.x tool calls (<tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>)."""

from __future__ import annotations

from parser_cases import Tok, check, check_error, factory

from ignition.testmodel import build_tokenizer

TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
TOKENIZER = build_tokenizer(("<|user|>", "<|assistant|>", "<think>", "</think>", *TAGS))
GLM = factory(TOKENIZER, "glm", "glm47", prompt=[Tok("<|assistant|>"), Tok("<think>")])
OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END = (Tok(t) for t in TAGS)
END = Tok("</think>")


def arg(key: str, value: str, sep: str = "") -> list:
    return [KEY, key, KEY_END, sep, VALUE, value, VALUE_END, sep]


def test_compact_glm47_call_after_reasoning() -> None:
    check(
        GLM,
        ["Need weather.", END, OPEN, "get_weather", *arg("city", "Paris"), *arg("days", "3"), CLOSE],
        [("reasoning", "Need weather."), ("call", "get_weather", {"city": "Paris", "days": 3})],
    )


def test_glm46_newline_separated_calls() -> None:
    one = [OPEN, "get_weather\n", *arg("city", "Rome", "\n"), CLOSE]
    check(
        GLM,
        [END, "\nChecking.\n", *one, "\n", OPEN, "get_time\n", CLOSE, "\n"],
        [("text", "\nChecking."), ("call", "get_weather", {"city": "Rome"}), ("call", "get_time", {})],
    )


def test_tool_call_mention_stays_text() -> None:
    check(
        GLM,
        [END, "The ", OPEN, " tag, or ", OPEN, "get_weather is a name."],
        [("text", "The  tag, or get_weather is a name.")],
    )
    check(
        GLM,
        ["Maybe ", OPEN, "get_weather", *arg("city", "Oslo"), CLOSE, END, "Answer"],
        [("reasoning", "Maybe get_weathercityOslo"), ("text", "Answer")],
    )


def test_values_raw_for_strings_and_json_otherwise() -> None:
    args = [*arg("note", "42"), *arg("on", "false"), *arg("opts", '{"k": "a b"}'), *arg("tags", "[3]")]
    check(
        GLM,
        [END, OPEN, "set_flags", *args, CLOSE],
        [("call", "set_flags", {"note": "42", "on": False, "opts": {"k": "a b"}, "tags": [3]})],
    )


def test_spelled_out_tags_inside_a_value_stay_text() -> None:
    check(
        GLM,
        [END, OPEN, "get_weather", *arg("city", "a <arg_value>b</arg_value> c"), CLOSE],
        [("call", "get_weather", {"city": "a <arg_value>b</arg_value> c"})],
    )


def test_missing_value_close_is_closed_by_the_next_key() -> None:
    check(
        GLM,
        [END, OPEN, "get_weather", KEY, "city", KEY_END, VALUE, "Paris", *arg("days", "2"), CLOSE],
        [("call", "get_weather", {"city": "Paris", "days": 2})],
    )


def test_undecided_or_unfinished_call_at_the_end() -> None:
    check_error(GLM, [END, "Ok.", OPEN, "get_weather"], "unfinished")
    check(GLM, [END, "Ok.", OPEN, "get_weather"], [("text", "Ok.")], truncated=True)
    check_error(GLM, [END, OPEN, "get_weather", KEY, "city"], "unfinished")
    check(GLM, [END, OPEN, "get_weather", KEY, "city"], [], truncated=True)


def test_argument_without_value_fails() -> None:
    check_error(GLM, [END, OPEN, "get_weather", KEY, "city", KEY_END, CLOSE], "no <arg_value>")
