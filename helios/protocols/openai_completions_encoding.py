"""OpenAI (legacy) Completions encoding: text choices with array-style logprobs, and the stream.

With echo, a choice starts with its prompt: the original text (or the decoded token-id
prompt) and, when logprobs are asked for, its prompt entries. A stream sends those entries
as one frame per prompt chunk the engine prefilled (as it reports them), before any
generated entry; the first frame carries the echoed text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helios.frontend.generate import ChoiceUpdate, Generation, Submission, Usage
from helios.frontend.inference import Termination
from helios.frontend.output import TokenEntry, text_offsets
from helios.protocols.encoding import Buffered, data_frame, json_body
from helios.protocols.errors import openai_error
from helios.protocols.openai_common import (
    ChunkStream,
    finish_reason,
    now,
    prompt_logprobs_wire,
    stream_chunk,
    usage_object,
)
from helios.protocols.openai_completions import CompletionOptions

TokenText = Callable[[int], str]


@dataclass
class Arrays:
    """Completions' parallel logprob arrays for one choice."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    chars: int = 0  # characters of text released so far (offsets of later tokens start here)

    def add_generated(self, entries: tuple[TokenEntry, ...], text: str) -> None:
        for entry, offset in zip(entries, text_offsets(entries, self.chars)):
            self.tokens.append(entry.token)
            self.token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for alt in entry.top:
                top.setdefault(alt.token, alt.logprob)  # several ids may decode to one string: the first wins
            self.top_logprobs.append(top)
            self.text_offset.append(offset)
        self.chars += len(text)

    def window(self, start: int, end: int | None = None) -> Arrays:
        """Entries [start, end): one stream frame's share."""
        return Arrays(
            self.tokens[start:end],
            self.token_logprobs[start:end],
            self.top_logprobs[start:end],
            self.text_offset[start:end],
            self.chars,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def add_prompt_entries(
    arrays: Arrays,
    prompt_ids: tuple[int, ...],
    offsets: tuple[int, ...],
    entries: tuple | None,
    token_text: TokenText,
    limit: int,
) -> None:
    """Echoed prompt positions: null first entry, then each prompt token's logprob and alternatives.
    `offsets`: each token's character offset in the echoed text (Generation.echo_offsets)."""
    for position, token_id in enumerate(prompt_ids):
        arrays.tokens.append(token_text(token_id))
        arrays.text_offset.append(offsets[position])
        entry = entries[position] if entries is not None and position < len(entries) else None
        if entry is None:
            arrays.token_logprobs.append(None)
            arrays.top_logprobs.append(None)
            continue
        arrays.token_logprobs.append(entry[token_id].logprob)
        alternatives = sorted(entry.items(), key=lambda item: (-item[1].logprob, item[0]))
        top: dict[str, float] = {}
        for alt_id, value in alternatives[: max(limit, 0)] + [(token_id, entry[token_id])]:
            top.setdefault(token_text(alt_id), value.logprob)
        arrays.top_logprobs.append(top)


def choice_json(
    index: int, text: str, arrays: Arrays | None, finish: Termination | None, prompt_logprobs: list | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": arrays.as_json() if arrays else None,
        "finish_reason": finish_reason(finish),
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def response(request_id: str, model: str, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": usage_object(usage, reasoning=False),
    }


def chunk(
    request_id: str, model: str, created: int, choice: dict[str, Any], usage: dict | None = None
) -> dict[str, Any]:
    return stream_chunk("text_completion", request_id, model, created, [choice], usage)


@dataclass
class _Choice:
    """One choice's output so far; `arrays` is None without logprobs."""

    text: str = ""
    arrays: Arrays | None = None
    finish: Termination | None = None


class _Choices:
    """Shared by both encoders: opening a choice with its echo, and adding generated output."""

    def __init__(self, run: Submission, options: CompletionOptions, token_text: TokenText) -> None:
        self.run, self.options, self.token_text = run, options, token_text
        self.choices: dict[int, _Choice] = {}

    def open(self, index: int) -> tuple[_Choice, bool]:
        """The choice, and whether this call created it (echoed text and prompt entries first)."""
        if index in self.choices:
            return self.choices[index], False
        choice = _Choice(arrays=Arrays() if self.options.logprobs is not None else None)
        if self.options.echo:
            generation = self.run.generation_of(index)
            choice.text = generation.echo
            if choice.arrays is not None:
                add_prompt_entries(
                    choice.arrays,
                    generation.prompt.token_ids,
                    generation.echo_offsets,
                    generation.prompt_logprobs,
                    self.token_text,
                    self.options.logprobs or 0,
                )
                choice.arrays.chars = len(generation.echo)  # generated offsets start after the echoed text
        self.choices[index] = choice
        return choice, True

    def add(self, choice: _Choice, update: ChoiceUpdate) -> None:
        if choice.arrays is not None:
            choice.arrays.add_generated(update.delta.entries, update.delta.text)
        choice.text += update.delta.text
        if update.finish is not None:
            choice.finish = update.finish.termination


def _windows(chunk_ends: tuple[int, ...], count: int, fallback: int) -> list[tuple[int, int]]:
    """Prompt-entry windows, one per prefill chunk the engine ran (fixed-size without its record)."""
    ends = [e for e in chunk_ends if 0 < e < count] + [count]
    if not chunk_ends:
        ends = list(range(fallback, count, fallback)) + [count]
    return [(a, b) for a, b in zip([0] + ends[:-1], ends) if b > a]


class CompletionStream(ChunkStream):
    """Completion chunks; streams may interleave choice indices."""

    kind = "text_completion"
    reasoning = False
    options: CompletionOptions

    def __init__(
        self, run: Submission, model: str, options: CompletionOptions, token_text: TokenText, prompt_chunk: int
    ) -> None:
        super().__init__(run, model, options)
        self.prompt_chunk = max(prompt_chunk, 1)  # prompt positions per echoed logprob frame
        self._choices = _Choices(run, options, token_text)

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        choice, opened = self._choices.open(update.index)
        out: list[bytes] = []
        text = choice.text if opened else ""  # a choice's first frame carries its echo
        start = len(choice.arrays.tokens) if choice.arrays is not None else 0  # this update's first entry
        if opened and choice.arrays is not None and start:  # echoed prompt entries: a frame per prompt chunk
            for first, end in _windows(
                self.run.generation_of(update.index).prompt_chunk_ends, start, self.prompt_chunk
            ):
                out.append(self._frame(update.index, text, choice.arrays.window(first, end), None))
                text = ""
        self._choices.add(choice, update)
        window = choice.arrays.window(start) if choice.arrays is not None else None
        finish = update.finish.termination if update.finish is not None else None
        out.append(self._frame(update.index, text + update.delta.text, window, finish))
        return out

    def _frame(self, index: int, text: str, arrays: Arrays | None, finish: Termination | None) -> bytes:
        usage = self.usage() if self.options.continuous_usage else None
        return data_frame(
            chunk(self.run.request_id, self.model, self.run.created, choice_json(index, text, arrays, finish), usage)
        )


class CompletionBuffer(Buffered):
    """The buffered text_completion: choices in index order, with per-prompt prompt_logprobs."""

    error_body = staticmethod(openai_error)

    def __init__(
        self, run: Submission, model: str, options: CompletionOptions, token_text: TokenText, decoded_text: TokenText
    ) -> None:
        self.run, self.model, self.options = run, model, options
        self.decoded_text = decoded_text  # prompt_logprobs' decoded_token stays text under token-id strings
        self._choices = _Choices(run, options, token_text)

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        choice, _ = self._choices.open(update.index)
        self._choices.add(choice, update)
        return []

    def finish(self) -> list[bytes]:
        choices = []
        for index, choice in sorted(self._choices.choices.items()):
            generation: Generation = self.run.generation_of(index)
            prompt_logprobs = prompt_logprobs_wire(
                generation.prompt_logprobs, self.decoded_text, limit=self.options.prompt_logprobs
            )
            choices.append(choice_json(index, choice.text, choice.arrays, choice.finish, prompt_logprobs))
        return [json_body(response(self.run.request_id, self.model, choices, self.run.usage()))]


def encoder(
    run: Submission,
    model: str,
    options: CompletionOptions,
    token_text: TokenText,
    decoded_text: TokenText,
    prompt_chunk: int,
) -> CompletionStream | CompletionBuffer:
    if run.request.stream:
        return CompletionStream(run, model, options, token_text, prompt_chunk)
    return CompletionBuffer(run, model, options, token_text, decoded_text)
