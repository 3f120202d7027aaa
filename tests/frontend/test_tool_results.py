"""Parallel tool results normalised to the calls' order before rendering (api.md, conversations)."""

from __future__ import annotations

from helios.frontend.inference import Message, TextPart, ToolCallPart, ToolResultPart
from helios.frontend.prompt import normalize_tool_results


def calls(*ids: str) -> Message:
    return Message("assistant", tuple(ToolCallPart(i, "f", "{}") for i in ids))


def result(call_id: str) -> Message:
    return Message("tool", (ToolResultPart(call_id, (TextPart(f"result {call_id}"),)),))


def user(text: str) -> Message:
    return Message("user", (TextPart(text),))


def ids(messages: list[Message]) -> list[str]:
    return [m.parts[0].call_id if m.role == "tool" else m.role for m in messages]


def test_results_follow_call_order_and_other_messages_keep_their_places() -> None:
    supplied = [calls("a", "b", "c"), result("c"), user("note"), result("a"), result("b"), user("next")]
    assert ids(normalize_tool_results(supplied)) == ["assistant", "a", "user", "b", "c", "user"]


def test_a_group_with_missing_duplicate_or_unknown_ids_is_left_as_supplied() -> None:
    for group in (
        [result("c"), result("a")],  # b is missing: no subset is reordered
        [result("b"), result("a"), result("a"), result("c")],  # a twice
        [result("c"), result("a"), result("z")],  # z was never called
        [result("c"), result("b"), result("a"), result("z")],
    ):
        supplied = [calls("a", "b", "c"), *group]
        assert normalize_tool_results(supplied) == supplied


def test_results_never_move_across_another_assistant_message() -> None:
    supplied = [calls("a", "b"), result("b"), Message("assistant", (TextPart("x"),)), result("a")]
    assert normalize_tool_results(supplied) == supplied  # the group after the first assistant lacks a
    ordered = [calls("a", "b"), result("b"), result("a"), calls("c", "d"), result("d"), result("c")]
    assert ids(normalize_tool_results(ordered)) == ["assistant", "a", "b", "assistant", "c", "d"]
