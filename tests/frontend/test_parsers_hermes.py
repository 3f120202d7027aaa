"""Hermes JSON calls (<tool_call>{...}</tool_call>), whose opener also ends Qwen3 reasoning."""

from __future__ import annotations

from parser_cases import Tok, check, check_error, factory

from ignition.testmodel import build_tokenizer

TOKENIZER = build_tokenizer(("<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"))
HERMES = factory(TOKENIZER, "qwen3", "hermes", prompt=[Tok("<think>"), "\n"])
OPEN, CLOSE = Tok("<tool_call>"), Tok("</tool_call>")
CALL = [OPEN, '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', CLOSE]


def test_call_ends_reasoning_and_spelled_tags_stay_text() -> None:
    check(
        HERMES,
        ["Look up <tool_call> in the docs.\n", *CALL, "\nDone."],
        [
            ("reasoning", "Look up <tool_call> in the docs."),
            ("call", "get_weather", {"city": "Paris"}),
            ("text", "Done."),
        ],
    )


def test_invalid_json_fails_and_truncated_call_is_omitted() -> None:
    check_error(HERMES, [Tok("</think>"), OPEN, '{"name": "x", ', CLOSE], "not valid JSON")
    check(HERMES, [Tok("</think>"), "Hi", OPEN, '{"name": "x", '], [("text", "Hi")], truncated=True)
