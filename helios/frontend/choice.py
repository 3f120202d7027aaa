"""One choice from engine events to semantic events: output pipeline, parsers, tool policy.

Tool policy (spec: conversation and tool semantics): required and named modes need at
least one completed call to an allowed tool; named mode hides answer text; a call to
another tool, or a second call when parallel calls are off, fails before it is emitted.
"""

from __future__ import annotations

from helios.engine import EngineEvent
from helios.frontend.events import FinishEvent, ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.inference import Termination, ToolChoice
from helios.frontend.output import ChoiceOutput, OutputDelta
from helios.frontend.parsers import ChoiceParser
from helios.frontend.parsers.tools import ToolCallError


class PolicyError(ValueError):
    pass


class ChoiceStream:
    def __init__(
        self,
        output: ChoiceOutput,
        parser: ChoiceParser | None,
        tool_choice: ToolChoice | None,
        declared: frozenset[str],
    ) -> None:
        self.output = output
        self.parser = parser
        self.tool_choice = tool_choice or ToolChoice()
        self.declared = declared
        self.calls = 0
        self.declared_calls = 0
        self.failed: str | None = None
        self.reasoning_tokens = 0

    @property
    def needs_abort(self) -> bool:
        return self.output.needs_abort or self.failed is not None

    def push(self, event: EngineEvent) -> tuple[OutputDelta, list[SemanticEvent]]:
        delta = self.output.push(event)
        if self.failed is not None:
            return delta, []
        events: list[SemanticEvent] = []
        try:
            if self.parser is None:
                if delta.text or delta.entries:
                    events.append(TextEvent(delta.text, delta.entries))
            else:
                for piece in delta.pieces:
                    parsed = self.parser.feed(piece)
                    # Parsers publish exactly one ReasoningEvent per token read as reasoning.
                    self.reasoning_tokens += sum(1 for e in parsed if isinstance(e, ReasoningEvent))
                    events += parsed
                if delta.finish is not None:
                    events += self.parser.finish(truncated=delta.finish is Termination.LENGTH)
            events = [e for item in events for e in self._policy(item)]
            if delta.finish is not None:
                events.append(self._finish(delta))
        except (ToolCallError, PolicyError) as exc:
            self.failed = str(exc)
            events.append(FinishEvent(Termination.ERROR, error=f"invalid tool call output: {exc}"))
        return delta, events

    def _policy(self, event: SemanticEvent) -> list[SemanticEvent]:
        mode = self.tool_choice.mode
        if isinstance(event, TextEvent) and mode == "named":
            return []  # named selection omits answer text (usage still counts it)
        if not isinstance(event, ToolCallEvent):
            return [event]
        if mode == "named" and event.name != self.tool_choice.name:
            raise PolicyError(f"the model called {event.name!r}, but tool_choice selects {self.tool_choice.name!r}")
        if self.calls >= 1 and not self.tool_choice.parallel:
            raise PolicyError("the model started a second tool call, but parallel_tool_calls is false")
        self.calls += 1
        self.declared_calls += event.name in self.declared
        return [event]

    def _finish(self, delta: OutputDelta) -> FinishEvent:
        termination = delta.finish
        assert termination is not None
        if termination is Termination.ERROR:
            return FinishEvent(termination, error=delta.error)
        if (
            self.tool_choice.mode in ("required", "named")
            and self.declared_calls == 0
            and termination is not Termination.ABORT
        ):
            self.failed = "no tool call"
            return FinishEvent(Termination.ERROR, error="tool_choice requires a tool call, and the model produced none")
        # Parsed calls complete an answer only where the user did not stop it: an explicit token
        # stop reports stop / end_turn like a string stop (api.md, finish causes).
        if self.calls and termination is Termination.EOS:
            return FinishEvent(Termination.TOOL_CALLS)
        return FinishEvent(termination, matched_stop=delta.matched_stop)
