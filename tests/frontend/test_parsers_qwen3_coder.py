"""Function-tag tool calls (Qwen3-Coder / Qwen3.5 / Nemotron / Step, MiMo) with <think> reasoning."""

from __future__ import annotations

import pytest
from parser_cases import Tok, check, check_error, factory, replay
from tokenizers import AddedToken

from helios.frontend.output import Piece
from helios.frontend.parsers.tools import ToolCallError
from ignition.testmodel import build_tokenizer

TOKENIZER = build_tokenizer(("<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"))
THINKING = factory(TOKENIZER, "qwen3", "qwen3_coder", prompt=[Tok("<think>"), "\n"])
ANSWER = factory(TOKENIZER, "qwen3", "qwen3_coder", prompt=[Tok("<think>"), "\n\n", Tok("</think>"), "\n\n"])
MIMO = factory(TOKENIZER, "think", "mimo")
OPEN, CLOSE, END = Tok("<tool_call>"), Tok("</tool_call>"), Tok("</think>")
WEATHER = (
    "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
)
PARIS = ("call", "get_weather", {"city": "Paris", "days": 3})


def test_call_after_reasoning() -> None:
    check(
        THINKING,
        ["I should check.", END, "\n\n", OPEN, WEATHER, CLOSE],
        [("reasoning", "I should check."), PARIS],
    )


def test_tool_call_tag_ends_reasoning_implicitly() -> None:
    check(
        THINKING,
        ["Let me look it up.\n", OPEN, WEATHER, CLOSE, "\nDone."],
        [("reasoning", "Let me look it up."), PARIS, ("text", "Done.")],
    )


def test_complete_call_written_inline_in_prose_ends_reasoning() -> None:
    inline = "<function=get_weather><parameter=city>Paris</parameter></function>"
    check(
        THINKING,
        ["I'll call ", OPEN, inline, CLOSE, " and then answer."],
        [("reasoning", "I'll call"), ("call", "get_weather", {"city": "Paris"}), ("text", "and then answer.")],
    )


def test_tag_mentioned_in_prose_stays_reasoning_or_text() -> None:
    check(
        THINKING,
        ["Wrap calls in a ", OPEN, " tag.", END, "Use ", OPEN, " tags."],
        [("reasoning", "Wrap calls in a  tag."), ("text", "Use  tags.")],
    )
    check(
        ANSWER,
        ["Write <function=name> then <parameter=key>.", OPEN, "<function=x> done"],
        [("text", "Write <function=name> then <parameter=key>.<function=x> done")],
    )


def test_outer_tags_may_be_omitted_in_answer_but_not_in_reasoning() -> None:
    bare = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
    check(
        ANSWER,
        ["Sure.\n", bare, "\n", CLOSE, "\n"],
        [("text", "Sure."), ("call", "get_weather", {"city": "Paris"})],
    )
    check(THINKING, [bare, END, "ok"], [("reasoning", bare), ("text", "ok")])


def test_spelled_out_delimiters_stay_text() -> None:
    # "</think>" and "<tool_call>" written as ordinary characters are not the delimiter tokens.
    check(
        THINKING,
        ["The </think> tag. <tool_call>", WEATHER, END, "Hi"],
        [("reasoning", "The </think> tag. <tool_call>" + WEATHER), ("text", "Hi")],
    )


def test_several_calls_in_one_block_and_in_separate_blocks() -> None:
    two = "\n<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
    check(
        ANSWER,
        [OPEN, two, CLOSE, "\n", OPEN, WEATHER, CLOSE],
        [("call", "get_time", {}), ("call", "get_weather", {"city": "Rome"}), PARIS],
    )


def test_missing_parameter_close_is_closed_by_the_next_boundary() -> None:
    body = "\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\n"
    check(ANSWER, [OPEN, body, CLOSE], [("call", "get_weather", {"city": "Paris", "days": 2})])


def test_one_wrapping_newline_trimmed_but_mimo_keeps_values_verbatim() -> None:
    body = "\n<function=get_weather>\n<parameter=city>\n\n  Paris\n\n</parameter>\n</function>\n"
    check(ANSWER, [OPEN, body, CLOSE], [("call", "get_weather", {"city": "\n  Paris\n"})])
    compact = (
        "\n<function=get_weather>\n<parameter=city>  Paris\n</parameter>\n<parameter=days>4</parameter>\n</function>\n"
    )
    check(MIMO, [OPEN, compact, CLOSE], [("call", "get_weather", {"city": "  Paris\n", "days": 4})])


def test_schema_guides_conversion_without_rejecting() -> None:
    params = {"on": "true", "ratio": "0.5", "note": "42", "tags": "[1, 2]", "opts": '{"k": "v"}'}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    check(
        ANSWER,
        [OPEN, f"\n<function=set_flags>\n{body}</function>\n", CLOSE],
        [("call", "set_flags", {"on": True, "ratio": 0.5, "note": "42", "tags": [1, 2], "opts": {"k": "v"}})],
    )
    loose = "\n<function=get_weather>\n<parameter=days>\nsoon\n</parameter>\n</function>\n"
    check(ANSWER, [OPEN, loose, CLOSE], [("call", "get_weather", {"days": "soon"})])
    unknown = "\n<function=lookup>\n<parameter=n>\n5\n</parameter>\n</function>\n"
    check(ANSWER, [OPEN, unknown, CLOSE], [("call", "lookup", {"n": "5"})])


def test_undecided_tag_at_the_end_is_an_incomplete_call() -> None:
    check_error(ANSWER, ["Sure. ", OPEN, "\n<function=get_wea"], "unfinished")
    check_error(ANSWER, ["Sure. ", OPEN], "unfinished")
    check(ANSWER, ["Sure. ", OPEN, "\n<function=get_wea"], [("text", "Sure.")], truncated=True)


def test_truncated_call_is_omitted_and_unfinished_call_is_an_error() -> None:
    partial = "\n<function=get_weather>\n<parameter=city>\nPar"
    check(ANSWER, ["Calling.", OPEN, partial], [("text", "Calling.")], truncated=True)
    check_error(ANSWER, ["Calling.", OPEN, partial], "unfinished")


def test_malformed_calls_fail() -> None:
    repeated = (
        "\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n</function>"
    )
    check_error(ANSWER, [OPEN, repeated, CLOSE], "repeats")


def test_arguments_are_bounded() -> None:
    huge = "\n<function=get_weather>\n<parameter=city>\n" + "x" * (8 << 20) + "\n</parameter>\n</function>\n"
    ids = [TOKENIZER.token_to_id("<tool_call>"), TOKENIZER.token_to_id("a")]
    with pytest.raises(ToolCallError, match="8 MiB"):
        replay(ANSWER, [Piece(ids[0], "", None), Piece(ids[1], huge, None)], truncated=False)


def test_visible_tool_tokens_show_their_spelling_when_they_are_text() -> None:
    # Qwen's tokenizers have <tool_call> as an added token that is not special, so the output
    # pipeline shows its spelling; the token still acts only when generated as that token.
    tokenizer = build_tokenizer(("<|im_end|>", "<think>", "</think>"))
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    answer = factory(tokenizer, "qwen3", "qwen3_coder", prompt=[Tok("<think>"), "\n\n", Tok("</think>"), "\n\n"])
    check(
        answer,
        ["Use ", OPEN, " tags.", OPEN, WEATHER, CLOSE, "\n"],
        [("text", "Use <tool_call> tags."), PARIS],
    )
