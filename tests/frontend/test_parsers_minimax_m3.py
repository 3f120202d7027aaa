"""MiniMax M3: <mm:think> reasoning and namespace-prefixed XML tool calls."""

from __future__ import annotations

from parser_cases import Tok, check, check_error, factory

from ignition.testmodel import build_tokenizer

NS_TEXT = "]<]minimax[>["
TOKENIZER = build_tokenizer(("]~!b[", "]~b]", "[e~[", NS_TEXT, "<mm:think>", "</mm:think>"))
MINIMAX = factory(TOKENIZER, "minimax_m3", "minimax_m3", prompt=[Tok("]~b]"), "ai\n"])
NS, THINK, END = Tok(NS_TEXT), Tok("<mm:think>"), Tok("</mm:think>")


def element(key: str, value: str) -> list:
    return [NS, f"<{key}>{value}", NS, f"</{key}>"]


def invoke(name: str, *elements: list) -> list:
    return [NS, f'<invoke name="{name}">', *(part for e in elements for part in e), NS, "</invoke>\n"]


def block(*invokes: list) -> list:
    return [NS, "<tool_call>\n", *(part for i in invokes for part in i), NS, "</tool_call>"]


def test_reasoning_then_calls_in_one_block() -> None:
    calls = block(invoke("get_weather", element("city", "Paris"), element("days", "3")), invoke("get_time"))
    check(
        MINIMAX,
        [THINK, "Two lookups.", END, "\n", *calls],
        [
            ("reasoning", "Two lookups."),
            ("call", "get_weather", {"city": "Paris", "days": 3}),
            ("call", "get_time", {}),
        ],
    )


def test_bare_think_close_starts_the_answer() -> None:
    check(MINIMAX, [END, "Hello."], [("text", "Hello.")])


def test_nested_values_follow_the_schema() -> None:
    tags = [NS, "<tags>", *element("item", "1"), *element("item", "2"), NS, "</tags>"]
    opts = [NS, "<opts>", *element("k", "v"), NS, "</opts>"]
    check(
        MINIMAX,
        [END, *block(invoke("set_flags", tags, opts, element("on", "true"), element("note", "7")))],
        [("call", "set_flags", {"tags": [1, 2], "opts": {"k": "v"}, "on": True, "note": "7"})],
    )
    check(
        MINIMAX,
        [END, *block(invoke("lookup", [NS, "<q>", *element("item", "a"), NS, "</q>"], element("n", "5")))],
        [("call", "lookup", {"q": ["a"], "n": "5"})],
    )


def test_unprefixed_or_spelled_out_tags_stay_text() -> None:
    check(
        MINIMAX,
        [THINK, "The </mm:think> tag", END, "Use <tool_call> or ]<]minimax[>[<tool_call> here."],
        [("reasoning", "The </mm:think> tag"), ("text", "Use <tool_call> or ]<]minimax[>[<tool_call> here.")],
    )


def test_truncated_block_is_omitted_and_unfinished_block_fails() -> None:
    partial = [NS, "<tool_call>\n", NS, '<invoke name="get_weather">', NS, "<city>Par"]
    check(MINIMAX, [END, "Calling.", *partial], [("text", "Calling.")], truncated=True)
    check_error(MINIMAX, [END, "Calling.", *partial], "unfinished")
    check_error(MINIMAX, [END, NS, "<tool_call>\n", "not a call"], "malformed")
