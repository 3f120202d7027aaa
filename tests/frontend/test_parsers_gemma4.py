"""Gemma 4: <|channel>thought reasoning and <|tool_call>call:NAME{...}<tool_call|> calls."""

from __future__ import annotations

from parser_cases import Tok, check, check_error, factory

from ignition.testmodel import build_tokenizer

TOKENIZER = build_tokenizer(("<turn|>", "<|turn>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'))
THINKING = factory(TOKENIZER, "gemma4", "gemma4", prompt=[Tok("<|turn>"), "model\n"])
NO_THINKING = factory(
    TOKENIZER, "gemma4", "gemma4", prompt=[Tok("<|turn>"), "model\n", Tok("<|channel>"), "thought\n", Tok("<channel|>")]
)
CHANNEL, CHANNEL_END, CALL, CALL_END, Q = (
    Tok(t) for t in ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>')
)


def test_thought_channel_is_reasoning() -> None:
    check(
        THINKING,
        [CHANNEL, "thought\nLet me think.\n", CHANNEL_END, "Answer."],
        [("reasoning", "Let me think.\n"), ("text", "Answer.")],
    )


def test_prefilled_empty_thought_means_answer_only() -> None:
    check(NO_THINKING, ["Hello ", CHANNEL_END, "there"], [("text", "Hello there")])


def test_other_channels_and_spelled_out_delimiters_stay_text() -> None:
    check(THINKING, [CHANNEL, "final\nHi"], [("text", "final\nHi")])
    check(
        THINKING,
        [CHANNEL, "thought\nthe <channel|> token", CHANNEL_END, "ok"],
        [("reasoning", "the <channel|> token"), ("text", "ok")],
    )


def test_call_with_quoted_strings_and_bare_scalars() -> None:
    check(
        THINKING,
        [
            CHANNEL,
            "thought\nweather",
            CHANNEL_END,
            CALL,
            "call:get_weather{city:",
            Q,
            "Paris, FR",
            Q,
            ",days:2}",
            CALL_END,
        ],
        [("reasoning", "weather"), ("call", "get_weather", {"city": "Paris, FR", "days": 2})],
    )


def test_nested_values() -> None:
    body = ["call:set_flags{on:true,opts:{k:", Q, "v: {x}", Q, "},ratio:0.5,tags:[1,2],note:null}"]
    check(
        THINKING,
        ["Setting.", CALL, *body, CALL_END, CALL, "call:get_time{}", CALL_END],
        [
            ("text", "Setting."),
            ("call", "set_flags", {"on": True, "opts": {"k": "v: {x}"}, "ratio": 0.5, "tags": [1, 2], "note": None}),
            ("call", "get_time", {}),
        ],
    )


def test_opener_always_starts_a_call() -> None:
    check_error(THINKING, ["See ", CALL, " for calls", CALL_END], "call:NAME")
    check_error(THINKING, ["See ", CALL, " for calls"], "unfinished")


def test_truncated_call_is_omitted() -> None:
    check(
        THINKING,
        ["Checking.", CALL, "call:get_weather{city:", Q, "Pa"],
        [("text", "Checking.")],
        truncated=True,
    )
    check_error(THINKING, ["Checking.", CALL, "call:get_weather{city:", Q, "Pa"], "unfinished")
