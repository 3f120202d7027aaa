"""One table of termination causes, mapped by all four protocols (spec: conversation semantics)."""

from __future__ import annotations

import pytest

from helios.frontend.events import FinishEvent
from helios.frontend.inference import Termination
from helios.protocols import anthropic_messages, openai_responses
from helios.protocols.openai_common import finish_reason

# cause -> (Chat finish_reason, Completions finish_reason, Messages stop_reason, Responses status)
TABLE = {
    Termination.EOS: ("stop", "stop", "end_turn", "completed"),
    Termination.STOP_TOKEN: ("stop", "stop", "end_turn", "completed"),
    Termination.STOP_STRING: ("stop", "stop", "stop_sequence", "completed"),
    Termination.LENGTH: ("length", "length", "max_tokens", "incomplete"),
    Termination.TOOL_CALLS: ("tool_calls", None, "tool_use", "completed"),  # Completions rejects tools
    Termination.ABORT: ("stop", "stop", "end_turn", "completed"),
}


@pytest.mark.parametrize("cause", list(TABLE), ids=[c.value for c in TABLE])
def test_every_protocol_maps_the_cause(cause: Termination) -> None:
    chat, completion, messages, responses = TABLE[cause]
    finish = FinishEvent(cause, matched_stop="END" if cause is Termination.STOP_STRING else None)
    assert finish_reason(cause) == chat
    if completion is not None:
        assert finish_reason(cause) == completion
    reason, sequence = anthropic_messages.stop_reason(finish)
    assert reason == messages and sequence == ("END" if cause is Termination.STOP_STRING else None)
    assert openai_responses.status_of(finish) == responses


def test_errors_fail_everywhere() -> None:
    assert openai_responses.status_of(FinishEvent(Termination.ERROR, error="x")) == "failed"
