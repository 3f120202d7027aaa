"""Decisions input (spec: POST /v1/decisions): text, or user messages of text and input_text parts."""

from __future__ import annotations

import pytest

from helios.frontend.inference import RequestError
from helios.protocols.decisions import decode

QUESTION = {"type": "predicate", "instructions": "Refund requested?"}


def _text(value) -> str:
    return decode({"model": "m", "input": value, "questions": [QUESTION]}).text


def test_text_and_input_text_parts_are_both_accepted() -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Charged twice"}, {"type": "input_text", "text": "on May 2"}],
        },
        {"type": "message", "role": "user", "content": [{"type": "text", "text": "Please help"}]},
    ]
    assert (
        _text(messages) == "Charged twice\non May 2\n\nPlease help"
    )  # parts join with newlines, messages with blank lines
    assert _text("Charged twice") == "Charged twice"


@pytest.mark.parametrize(
    ("part", "where"),
    [
        ({"type": "input_image", "image_url": "data:image/png;base64,AA=="}, "input.0.content.0"),
        ({"type": "output_text", "text": "x"}, "input.0.content.0.type"),
        ({"type": "text", "text": "x", "extra": 1}, "input.0.content.0.extra"),
    ],
)
def test_other_parts_are_refused_naming_the_field(part: dict, where: str) -> None:
    with pytest.raises(RequestError) as error:
        _text([{"role": "user", "content": [part]}])
    assert error.value.param == where
