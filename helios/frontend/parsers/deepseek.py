"""DeepSeek V4 / V4.1 output: the pinned official deepseek-recipe state machine as neutral events.

The official stream processor owns markup recognition (the reasoning close, DSML blocks, invokes
and parameters, its tolerance of omitted or partial tags, and discarding text after the calls
block) and matches every delimiter as text. This adapter feeds it each piece's text, turns its
Chat deltas into reasoning and answer events, and buffers each call's argument fragments until
they close one JSON object, which it validates like every other syntax's calls.
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as ds
from tokenizers import Tokenizer

from helios.frontend.events import ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.output import Piece, TokenEntry
from helios.frontend.parsers.envelope import MAX_ARGUMENT_BYTES, ToolCallError, make_call, put_argument

REASONING_SYNTAX = "deepseek"
TOOL_SYNTAX = "deepseek_dsml_v4"
_MARKUP = (ds.SpecialToken.ThinkingStart, ds.SpecialToken.ThinkingEnd, ds.SpecialToken.Dsml)
DSML = ds.SpecialToken.Dsml.default_str()
_THINK, _UNTHINK = ds.SpecialToken.ThinkingStart.default_str(), ds.SpecialToken.ThinkingEnd.default_str()
_BLOCK_OPENERS = (f"<{DSML}tool_calls>", f"<{DSML} calls>")  # V4 and V4.1 spell the calls block apart
_PROMPT_TAIL = 16  # prompt tokens inspected for where the generation prompt leaves the output


def output_start(tokenizer: Tokenizer, prompt_ids: tuple[int, ...]) -> tuple[bool, bool]:
    """(inside reasoning, inside a calls block) where the generation prompt ends: the encoder opens
    reasoning with <think> and, for a required tool choice, the calls block too."""
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL:]), skip_special_tokens=False)
    in_calls = tail.rstrip().endswith(_BLOCK_OPENERS)
    thinking = tail.rfind(_THINK) > tail.rfind(_UNTHINK)
    return thinking and not in_calls, in_calls


class _Pairs(list):
    """A JSON object as its key/value pairs, so repeated keys stay visible."""


def _plain(value: Any) -> Any:
    if isinstance(value, _Pairs):
        return {key: _plain(item) for key, item in value}
    return [_plain(item) for item in value] if isinstance(value, list) else value


class _Call:
    """One call's argument fragments, with a string-aware brace depth that says when they close."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[str] = []
        self.size = 0  # UTF-8 bytes so far
        self.depth = 0
        self.opened = False
        self.in_string = self.escaped = False
        self.done = False  # published

    def extend(self, fragment: str) -> bool:
        """Add a fragment; True when the arguments have just closed their outer object."""
        if self.done:
            raise ToolCallError(f"tool call {self.name!r} arguments continue after their JSON object closed")
        self.parts.append(fragment)
        self.size += len(fragment.encode())
        if self.size > MAX_ARGUMENT_BYTES:
            raise ToolCallError("tool call arguments exceed 8 MiB")
        for char in fragment:
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char == "{":
                self.depth, self.opened = self.depth + 1, True
            elif char == "}":
                self.depth -= 1
            elif not self.opened and not char.isspace():
                raise ToolCallError(f"tool call {self.name!r} arguments must be a JSON object")
        return self.opened and self.depth <= 0

    def publish(self) -> ToolCallEvent:
        """The validated call (see envelope.make_call), with nonempty, unique argument names."""
        try:
            value = json.loads("".join(self.parts), object_pairs_hook=_Pairs)
        except ValueError:
            raise ToolCallError(f"tool call {self.name!r} arguments are not valid JSON") from None
        if not isinstance(value, _Pairs):
            raise ToolCallError(f"tool call {self.name!r} arguments must be a JSON object")
        arguments: dict[str, object] = {}
        for key, item in value:
            put_argument(arguments, key, _plain(item))
        self.done = True
        return make_call(self.name, arguments)


class DeepseekParser:
    """One choice's parser: `feed` one settled piece at a time, then `finish` once."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: tuple[int, ...],
        reasoning: bool,
        tools_on: bool,
        structured: bool = False,
    ) -> None:
        thinking, in_calls = output_start(tokenizer, prompt_ids)
        thinking = thinking and reasoning
        added = tokenizer.get_added_tokens_decoder()
        spellings = {t.default_str(): tokenizer.token_to_id(t.default_str()) for t in _MARKUP}
        # Special tokens release no text; the official parser reads their spellings.
        self._hidden = {i: s for s, i in spellings.items() if i is not None and i in added and added[i].special}
        self._close_id = spellings[_UNTHINK]
        stage = ds.ThinkingInitialStage.ReasoningStart if thinking else None
        options = ds.ParsingOptions(
            parse_tool_calls=tools_on,
            starts_in_tool_calls=in_calls and tools_on,
            thinking_initial_stage=stage,
            stop_sequences=[],
        )
        # The V4.1 state machine reads both calls-block spellings; no conversation details reach it.
        request = ds.ConversationRequest(ds.Conversation([]), ds.ModelVersion.DeepseekV41Flash)
        chunks = ds.ChatCompletionRequest.chunk_generator(request, "flare", "flare")
        self._processor = ds.StreamProcessor(chunks, options)
        self._processor.push(ds.InferenceChunk.ready())
        self.structured = structured  # under an output constraint: the answer is verbatim once it begins
        self.verbatim = False
        self.reasoning = thinking  # the output is still in its reasoning region
        self._call: _Call | None = None
        self._call_index = -1
        self._pending: tuple[TokenEntry, ...] = ()  # entries of tokens whose text the official parser holds
        self._tool_seen = False  # the piece being fed produced call markup

    def feed(self, piece: Piece) -> list[SemanticEvent]:
        entries = (piece.entry,) if piece.entry is not None else ()
        if self.verbatim:  # a structured answer may spell markup; it is the answer's text
            return [TextEvent(piece.text, entries)]
        text = piece.text + self._hidden.get(piece.token_id, "")
        was_reasoning, self._tool_seen = self.reasoning, False
        if self.structured:
            events = self._step(text, len(piece.text))
        else:
            events = self._events(self._push(ds.InferenceChunk.text(text, 1)))
        if piece.token_id == self._close_id:
            self.reasoning = False
        if self._tool_seen and not isinstance(next(iter(events), None), (TextEvent, ReasoningEvent)):
            entries = ()  # a token of call markup carries no text entry
        events = self._attach(events, entries)
        # Usage counts one reasoning event per token read as reasoning: that wrote reasoning text,
        # or that wrote nothing else while reasoning was open (a held or closing delimiter).
        if was_reasoning and not events:
            return [ReasoningEvent("", self._take_pending())]
        return events

    def finish(self, truncated: bool) -> list[SemanticEvent]:
        if self.verbatim:
            return []
        reason = ds.InferenceFinishReason.Length if truncated else ds.InferenceFinishReason.Stop
        events = self._events(self._close(reason))
        call, self._call = self._call, None
        if call is not None and not call.done and not truncated:  # a truncated call is omitted
            raise ToolCallError("the model ended inside an unfinished tool call")
        return self._attach(events, ())

    def _step(self, text: str, shown: int) -> list[SemanticEvent]:
        """Structured output: feed one character at a time until answer text begins, then hand the
        rest of the piece's shown text (`text[:shown]`; a hidden token's spelling follows it) and
        whatever the official parser still holds to the answer verbatim."""
        events: list[SemanticEvent] = []
        for at, char in enumerate(text):
            for event in self._events(self._push(ds.InferenceChunk.text(char, 1 if at == len(text) - 1 else 0))):
                _append(events, event)
            if any(isinstance(e, TextEvent) and e.text for e in events):
                held = self._events(self._close(ds.InferenceFinishReason.Stop))
                self.verbatim, self.reasoning = True, False
                rest = "".join(e.text for e in held if isinstance(e, TextEvent)) + text[at + 1 : shown]
                return events + ([TextEvent(rest)] if rest else [])
        return events

    def _push(self, chunk: ds.InferenceChunk) -> list[dict[str, Any]]:
        try:
            return _deltas(self._processor.push(chunk))
        except RuntimeError as exc:
            raise ToolCallError(f"the DeepSeek output parser failed: {exc}") from None

    def _close(self, reason: ds.InferenceFinishReason) -> list[dict[str, Any]]:
        """End the official parser's input: it releases what it held back."""
        deltas = self._push(ds.InferenceChunk.finish(reason))
        try:
            return deltas + _deltas(self._processor.finish())
        except RuntimeError as exc:
            raise ToolCallError(f"the DeepSeek output parser failed: {exc}") from None

    def _events(self, deltas: list[dict[str, Any]]) -> list[SemanticEvent]:
        events: list[SemanticEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                _append(events, ReasoningEvent(delta["reasoning_content"]))
            if delta.get("content"):
                self._end_call()
                self.reasoning = False
                _append(events, TextEvent(delta["content"]))
            for call in delta.get("tool_calls") or ():
                self.reasoning, self._pending, self._tool_seen = False, (), True
                function = call.get("function") or {}
                if call.get("index") != self._call_index:
                    self._end_call()
                    self._call_index, self._call = call.get("index"), _Call(function.get("name") or "")
                assert self._call is not None
                if self._call.extend(function.get("arguments") or ""):
                    events.append(self._call.publish())
        return events

    def _end_call(self) -> None:
        """The official parser moved past the current call: its arguments must have closed."""
        if self._call is not None and not self._call.done:  # a closed object was published (or failed)
            raise ToolCallError(f"tool call {self._call.name!r} ended before its arguments were complete")
        self._call = None

    def _attach(self, events: list[SemanticEvent], entries: tuple[TokenEntry, ...]) -> list[SemanticEvent]:
        """Entries ride on the first text or reasoning event; until one comes, they wait."""
        self._pending += entries
        for index, event in enumerate(events):
            if isinstance(event, (TextEvent, ReasoningEvent)):
                events[index] = type(event)(event.text, self._take_pending())
                break
        return events

    def _take_pending(self) -> tuple[TokenEntry, ...]:
        pending, self._pending = self._pending, ()
        return pending


def _deltas(chunks: list[Any]) -> list[dict[str, Any]]:
    """The Chat deltas of the official parser's chunks, in order."""
    return [
        choice.get("delta") or {} for chunk in chunks for choice in json.loads(chunk.to_json()).get("choices") or ()
    ]


def _append(events: list[SemanticEvent], event: TextEvent | ReasoningEvent) -> None:
    """Consecutive deltas of one kind merge, so a piece yields at most one reasoning event."""
    if events and type(events[-1]) is type(event):
        events[-1] = type(event)(events[-1].text + event.text)  # type: ignore[union-attr]
    else:
        events.append(event)
