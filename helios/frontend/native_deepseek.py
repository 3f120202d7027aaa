"""Native DeepSeek V4 / V4.1 prompts: the pinned official deepseek-recipe encoders, our tokenizer.

Cores whose recipe template source is native:deepseek_v4 or native:deepseek_v41 lower chats
through the official encoder instead of Jinja. Text between the encoder's special ranges is
encoded without the tokenizer's added vocabulary, and each special range is exactly one token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import deepseek_recipe as ds
from tokenizers import Tokenizer

from helios.core.bundle import CoreError
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    Message,
    OutputConstraint,
    RequestError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)

VERSIONS = {"native:deepseek_v4": "DeepSeek V4", "native:deepseek_v41": "DeepSeek V4.1"}
LEVELS = ("low", "high", "xhigh", "max")  # the named efforts both encoders accept
SCORES = {"low": 50, "high": 75, "xhigh": 75, "max": 100}  # V4.1's score for each named level
SCORE_LEVEL = "high"  # a numeric V4.1 effort renders with this level, then takes its own score
EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)"
# Tokens every rendered prompt may hold; a core whose tokenizer lacks one cannot serve this encoder.
REQUIRED_TOKENS = (
    ds.SpecialToken.Bos,
    ds.SpecialToken.Eos,
    ds.SpecialToken.System,
    ds.SpecialToken.User,
    ds.SpecialToken.Assistant,
    ds.SpecialToken.ThinkingStart,
    ds.SpecialToken.ThinkingEnd,
    ds.SpecialToken.Dsml,
)
_ALL_TOKENS = tuple(getattr(ds.SpecialToken, name) for name in dir(ds.SpecialToken) if name[:1].isupper())
_TOOL_CHOICE = {"auto": "auto", "named": "auto", "none": "none", "required": "required"}  # named: one tool, auto


@dataclass(frozen=True, slots=True)
class Reasoning:
    """One request's reasoning controls, validated for the encoder."""

    thinking: bool  # thinking mode; off renders no effort prefix
    effort: str | None  # a named level (LEVELS) for the encoder; None: the encoder's own default (high)
    score: int | None  # V4.1 only: 1..100, written into the effort line in place of the level's score


class NativeEncoder:
    """One core's official encoder; `encode` is safe to call concurrently."""

    def __init__(self, source: str, tokenizer: Tokenizer, levels: Sequence[str], default_effort: str | None) -> None:
        self.name = VERSIONS[source]
        self.numeric = source == "native:deepseek_v41"  # V4.1 also takes integer efforts 1..100
        self._encoding = ds.DeepseekV41Encoding() if self.numeric else ds.DeepseekV4Encoding()
        self._tokenizer = tokenizer
        self._levels = tuple(level for level in levels if level in LEVELS) or LEVELS
        self._default = default_effort if default_effort in self._levels else None
        self._ids = {t.default_str(): tokenizer.token_to_id(t.default_str()) for t in _ALL_TOKENS}
        missing = [t.default_str() for t in REQUIRED_TOKENS if self._ids[t.default_str()] is None]
        if missing:
            raise CoreError(
                f"the {self.name} native encoder needs these special tokens as single tokens, and the "
                f"core's tokenizer lacks them: {', '.join(missing)}; re-export from a DeepSeek "
                "checkpoint, or use a recipe with a Jinja template"
            )
        self._system = ds.SpecialToken.System.default_str()
        self._inline_system: bool | None = None

    @classmethod
    def for_source(
        cls, source: str, tokenizer: Tokenizer, levels: Sequence[str], default_effort: str | None
    ) -> NativeEncoder | None:
        """The encoder a recipe's template source names; None for Jinja sources."""
        if not source.startswith("native:"):
            return None
        if source not in VERSIONS:
            raise CoreError(
                f"unknown native template {source!r} (this helios has {', '.join(VERSIONS)}); "
                "upgrade helios or re-export the core"
            )
        return cls(source, tokenizer, levels, default_effort)

    def encode(
        self,
        conversation: Conversation,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        kwargs: Mapping[str, object],
        output: OutputConstraint | None,
    ) -> tuple[tuple[int, ...], str]:
        """(token ids, prompt text) of arranged `messages` with the presented `tools`; `kwargs` are
        the request's template options after the frontend's effort resolution."""
        self._check_controls(conversation, kwargs)
        reasoning = self.reasoning(conversation, kwargs)
        turns = [_message(m) for m in messages]
        try:
            native = ds.Conversation(
                turns,
                thinking_mode=reasoning.thinking,
                tools=[ds.ToolDefinition(t.name, t.description, json.loads(json.dumps(t.parameters))) for t in tools],
                tool_choice=_TOOL_CHOICE[conversation.tool_choice.mode],  # type: ignore[arg-type]
                reasoning_effort=reasoning.effort,  # type: ignore[arg-type]
                **_response_format(output),
            )
            rendered = self._encoding.render_conversation(native)
        except (ValueError, RuntimeError, ds.ConversionError) as exc:
            raise RequestError(f"the {self.name} encoder cannot render this conversation: {exc}", "messages") from None
        prompt, ranges = rendered.prompt, list(rendered.special_ranges)
        if reasoning.score is not None and reasoning.thinking:
            prompt, ranges = self._with_score(prompt, ranges, reasoning.score)
        return self._token_ids(prompt, ranges), prompt

    def supports_inline_system(self) -> bool:
        """Whether a later system message stays in the prompt (probed once, as for Jinja templates)."""
        if self._inline_system is None:
            probe = "PROBE-SYS-native"
            turns = [ds.UserMessage("U1"), ds.AssistantMessage("A1"), ds.SystemMessage(probe), ds.UserMessage("U2")]
            self._inline_system = probe in self._encoding.render_conversation(ds.Conversation(turns)).prompt
        return self._inline_system

    def reasoning(self, conversation: Conversation, kwargs: Mapping[str, object]) -> Reasoning:
        """Thinking (on unless turned off) and effort: kwargs' reasoning_effort (explicit, or the
        request's neutral level as the frontend resolved it), else the prepared default."""
        thinking = conversation.thinking is not False
        for key in ("thinking", "enable_thinking"):  # enable_thinking wins when both are given
            value = kwargs.get(key)
            if value is not None and not isinstance(value, bool):
                raise RequestError(f"{key} must be a boolean (got {value!r})", key)
            thinking = thinking if value is None else value
        if "reasoning_effort" not in kwargs:
            return Reasoning(thinking, self._default, None)
        value = kwargs["reasoning_effort"]
        if value is None:
            return Reasoning(thinking, None, None)  # explicit null: the encoder's default
        if isinstance(value, str) and value in self._levels:
            return Reasoning(thinking, value, None)
        if isinstance(value, int) and not isinstance(value, bool) and self.numeric and 1 <= value <= 100:
            return Reasoning(thinking, SCORE_LEVEL, value)
        accepted = ", ".join(self._levels) + (", or an integer from 1 through 100" if self.numeric else "")
        numeric = " (it takes no numeric scores)" if not self.numeric else ""
        raise RequestError(
            f"reasoning_effort for {self.name}{numeric} must be one of {accepted}; got {value!r}", "reasoning_effort"
        )

    def _check_controls(self, conversation: Conversation, kwargs: Mapping[str, object]) -> None:
        """Controls the native encoders do not offer (spec: both reject these)."""
        if conversation.continue_final_message:
            raise RequestError(
                f"the {self.name} encoder does not support assistant continuation "
                "(continue_final_message or an assistant prefill)",
                "continue_final_message",
            )
        if not conversation.add_generation_prompt:
            raise RequestError(
                f"the {self.name} encoder always adds the generation prompt; "
                "add_generation_prompt=false is not supported",
                "add_generation_prompt",
            )
        if "drop_thinking" in kwargs:
            raise RequestError(f"the {self.name} encoder does not support drop_thinking", "drop_thinking")

    def _with_score(self, prompt: str, ranges: list[tuple[int, int]], score: int) -> tuple[str, list[tuple[int, int]]]:
        """Write `score` into the effort line, which V4.1 puts right after its first system token."""
        line = EFFORT_LINE.format(SCORES[SCORE_LEVEL])
        start = next((end for begin, end in ranges if prompt[begin:end] == self._system), -1)
        if start < 0 or not prompt.startswith(line, start):
            raise RuntimeError("the V4.1 encoder no longer writes its effort line after the first system token")
        new = EFFORT_LINE.format(score)
        shift = len(new) - len(line)
        ranges = [(begin, end) if begin < start else (begin + shift, end + shift) for begin, end in ranges]
        return prompt[:start] + new + prompt[start + len(line) :], ranges

    def _token_ids(self, prompt: str, ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        ids: list[int] = []
        at = 0
        for begin, end in ranges:
            ids += self._plain(prompt[at:begin])
            token = self._ids.get(prompt[begin:end])
            if token is None:
                raise RequestError(
                    f"the prompt needs the special token {prompt[begin:end]!r}, which this core's tokenizer lacks",
                    "messages",
                )
            ids.append(token)
            at = end
        return tuple(ids + self._plain(prompt[at:]))

    def _plain(self, text: str) -> list[int]:
        """Text encoded without the added vocabulary: a special spelling in it stays text."""
        if not text:
            return []
        tokenizer = self._tokenizer
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        words = (
            tokenizer.pre_tokenizer.pre_tokenize_str(text) if tokenizer.pre_tokenizer is not None else [(text, None)]
        )
        return [token.id for word, _ in words for token in tokenizer.model.tokenize(word)]


def _message(message: Message) -> ds.Message:
    texts: list[str] = []
    calls: list[ds.ToolCall] = []
    call_id: str | None = None
    for part in message.parts:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, ToolCallPart):
            calls.append(ds.ToolCall(part.call_id, part.name, _arguments(part)))
        elif isinstance(part, ToolResultPart):
            call_id = part.call_id
            if any(isinstance(p, ImagePart) for p in part.content):
                raise RequestError("this model does not accept images (its core has no vision program)", "messages")
            texts += [p.text for p in part.content if isinstance(p, TextPart)]
        elif isinstance(part, ImagePart):
            raise RequestError("this model does not accept images (its core has no vision program)", "messages")
    content = "\n\n".join(texts)
    if message.role == "system":
        return ds.SystemMessage(content)
    if message.role == "assistant":
        return ds.AssistantMessage(content, message.reasoning(), calls or None)
    if message.role == "tool":
        return ds.ToolMessage(content, call_id)
    return ds.UserMessage(content)


def _arguments(part: ToolCallPart) -> str:
    text = part.arguments or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise RequestError(f"tool call {part.call_id!r} arguments are not a JSON object", "messages")
    return text


def _response_format(output: OutputConstraint | None) -> dict[str, object]:
    """The encoder's own JSON response-format prompt (grammars get none, as with Jinja templates)."""
    if output is None or output.kind not in ("json_schema", "json_object"):
        return {}
    if output.kind == "json_object":
        return {"response_format": "json_object"}
    return {"response_schema": json.loads(output.definition)}
