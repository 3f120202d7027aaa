"""Anthropic Messages: wire JSON <-> neutral request, and message / named-SSE encoding.

Decoding validates once and builds a Conversation; encoding renders the accumulated
blocks (buffered) or the semantic events (stream) as Messages content blocks.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import date
from typing import Any

from helios.frontend.events import Accumulator, FinishEvent, ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.generate import Usage
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    InferenceRequest,
    Message,
    OutputConstraint,
    Part,
    ReasoningPart,
    RequestError,
    Termination,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    ToolSpec,
)
from helios.protocols import fields as f
from helios.protocols.errors import anthropic_error
from helios.protocols.output_format import messages_output_format

API_VERSION = "2023-06-01"
MIN_API_VERSION = date.fromisoformat(API_VERSION)
SIGNATURE_PREFIX = "flare-thinking-v1:"
UNSUPPORTED = ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids", "prompt_logprobs")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
MAX_APPLIED_BUDGET = (1 << 31) - 1  # larger Messages budgets are accepted but never cut reasoning
MAX_CACHE_BOUNDARIES = 4


@dataclass(frozen=True, slots=True)
class MessagesOptions:
    """Protocol-level options that do not reach the engine."""

    model: str  # echoed back; the loaded model always answers
    stream: bool
    thinking_enabled: bool | None  # thinking.type enabled/adaptive -> True, disabled -> False, omitted -> None
    budget: int | None  # the requested reasoning budget, even above 2**31-1 where it is not applied as a cut
    effort: str | None  # neutral level: output_config.effort, else derived from the budget
    explicit_budget: bool = False  # thinking_token_budget was sent (a hard cap, never only a hint)


def thinking_signature(text: str) -> str:
    """The deterministic marker on thinking blocks Flare emits (a round-trip check, not authentication)."""
    return SIGNATURE_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------- decoding
def _check_version(version: str | None) -> None:
    """2023-06-01, or any later real YYYY-MM-DD date (SDKs send their own release's date):
    every accepted version means 2023-06-01 semantics."""
    try:
        day = date.fromisoformat(version) if version and re.fullmatch(r"\d{4}-\d{2}-\d{2}", version) else None
    except ValueError:
        day = None
    if day is None or day < MIN_API_VERSION:
        raise RequestError(
            f"anthropic-version header must be {API_VERSION!r} or a later YYYY-MM-DD date (got {version!r})", None
        )


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and isinstance(b.get("type"), str) for b in content
    ):
        raise RequestError(f"{where} content must be a string or an array of typed blocks", "messages")
    return content


def _text(block: dict[str, Any], where: str) -> TextPart:
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}: text blocks need a string text", "messages")
    return TextPart(block["text"])


def _image(block: dict[str, Any], where: str) -> ImagePart:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise RequestError(f"{where}: images need a base64 source (URL and file sources are unsupported)", "messages")
    if source.get("media_type") not in IMAGE_TYPES:
        raise RequestError(
            f"{where}: unsupported image type {source.get('media_type')!r} (PNG, JPEG or static WebP)", "messages"
        )
    try:
        return ImagePart(base64.b64decode(source.get("data", ""), validate=True), source["media_type"])
    except (binascii.Error, ValueError, TypeError):
        raise RequestError(f"{where}: image data is not valid base64", "messages") from None


def _unsupported(kind: str, where: str) -> RequestError:
    if kind == "redacted_thinking":
        return RequestError(f"{where}: redacted_thinking blocks are unsupported (opaque reasoning)", "messages")
    return RequestError(f"{where}: {kind!r} content blocks are unsupported here", "messages")


def _system_parts(content: Any, where: str) -> tuple[TextPart, ...]:
    if isinstance(content, str):
        return (TextPart(content),) if content else ()
    blocks = _blocks(content, where)
    if any(b["type"] != "text" for b in blocks):
        raise RequestError(f"{where}: system content accepts only text blocks", "system")
    return tuple(p for p in (_text(b, where) for b in blocks) if p.text)


def _thinking_part(block: dict[str, Any], where: str) -> ReasoningPart:
    text, signature = block.get("thinking"), block.get("signature")
    if not isinstance(text, str) or not isinstance(signature, (str, type(None))):
        raise RequestError(f"{where}: thinking blocks need string thinking and signature", "messages")
    if signature and signature.startswith(SIGNATURE_PREFIX) and signature != thinking_signature(text):
        raise RequestError(
            f"{where}: thinking block was modified (its flare-thinking-v1 marker does not match)", "messages"
        )
    return ReasoningPart(text)


def _assistant_parts(content: Any, where: str) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(content),) if content else ()
    parts: list[Part] = []
    for block in _blocks(content, where):
        kind = block["type"]
        if kind == "text":
            parts.append(_text(block, where))
        elif kind == "thinking":
            parts.append(_thinking_part(block, where))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise RequestError(f"{where}: tool_use needs a string id, a nonempty name, object input", "messages")
            parts.append(ToolCallPart(call_id, name, json.dumps(arguments, ensure_ascii=False)))
        else:
            raise _unsupported(kind, where)
    return tuple(parts)


def _tool_result(block: dict[str, Any], where: str) -> ToolResultPart:
    call_id, content = block.get("tool_use_id"), block.get("content")
    if not isinstance(call_id, str):
        raise RequestError(f"{where}: tool_result blocks need a string tool_use_id", "messages")
    parts: list[TextPart | ImagePart] = []
    if isinstance(content, str):
        parts.append(TextPart(content))
    elif content is not None:
        for inner in _blocks(content, f"{where} tool_result"):
            if inner["type"] not in ("text", "image"):
                raise _unsupported(inner["type"], f"{where} tool_result")
            parts.append(_text(inner, where) if inner["type"] == "text" else _image(inner, where))
    is_error = block.get("is_error")
    if not isinstance(is_error, (bool, type(None))):
        raise RequestError(f"{where}: tool_result is_error must be a boolean", "messages")
    return ToolResultPart(call_id, tuple(parts), bool(is_error))


def _user_messages(content: Any, where: str, base: int, marks: list[tuple[int, int]]) -> list[Message]:
    """Tool results become tool messages in order; the rest stays one user message after them."""
    if isinstance(content, str):
        return [Message("user", (TextPart(content),))]
    tools: list[Message] = []
    parts: list[Part] = []
    spots: list[tuple[bool, int]] = []  # (is a tool result, its position) of each cache_control block
    for block in _blocks(content, where):
        kind = block["type"]
        if kind == "tool_result":
            tools.append(Message("tool", (_tool_result(block, where),)))
        elif kind in ("text", "image"):
            parts.append(_text(block, where) if kind == "text" else _image(block, where))
        else:
            raise _unsupported(kind, where)
        if block.get("cache_control") is not None:
            spots.append((kind == "tool_result", len(tools) - 1 if kind == "tool_result" else len(parts) - 1))
    marks += [(base + k, 0) if is_tool else (base + len(tools), k) for is_tool, k in spots]
    return tools + ([Message("user", tuple(parts))] if parts or not tools else [])


def _messages(body: dict[str, Any]) -> tuple[list[Message], list[tuple[int, int]]]:
    out: list[Message] = []
    system = body.get("system")
    if system is not None:
        parts = _system_parts(system, "system")
        out += [Message("system", parts)] if parts else []
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestError("messages must be a nonempty array", "messages")
    marks: list[tuple[int, int]] = []
    for index, raw in enumerate(raw_messages):
        role = raw.get("role") if isinstance(raw, dict) else None
        where = f"messages[{index}]"
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"{where}: role must be user, assistant or system (got {role!r})", "messages")
        if role == "system":
            parts = _system_parts(raw.get("content"), where)
            out += [Message("system", parts)] if parts else []
        elif role == "assistant":
            out.append(Message("assistant", _assistant_parts(raw.get("content"), where)))
        else:
            out += _user_messages(raw.get("content"), where, len(out), marks)
    return out, marks[:MAX_CACHE_BOUNDARIES]


def _tools(body: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice]:
    specs = []
    for tool in f.tools(body):
        tool = tool if isinstance(tool, dict) else {}
        if tool.get("type") not in (None, "custom"):
            raise RequestError(f"server tool {tool['type']!r} is unsupported (only client tools)", "tools")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise RequestError("each tool needs a nonempty name and an input_schema object", "tools")
        if tool.get("strict") is True:
            raise RequestError("strict tool schemas are not supported", "tools")
        description = tool.get("description")
        specs.append(ToolSpec(name, description if isinstance(description, str) else None, schema))
    choice = f.optional_object(body, "tool_choice")
    if choice is None:
        return tuple(specs), ToolChoice()
    mode = TOOL_CHOICES.get(str(choice.get("type")))
    if mode is None:
        raise RequestError("tool_choice.type must be auto, any, tool or none", "tool_choice")
    if mode == "required" and not specs:
        raise RequestError("tool_choice any needs at least one declared tool", "tool_choice")
    name = choice.get("name") if mode == "named" else None
    if mode == "named" and name not in {s.name for s in specs}:
        raise RequestError(f"tool_choice names tool {name!r}, which is not declared in tools", "tool_choice")
    parallel = not f.optional_bool(choice, "disable_parallel_tool_use")
    return tuple(specs), ToolChoice(mode, name, parallel)


def _thinking(body: dict[str, Any]) -> tuple[bool | None, int | None, str | None]:
    """(thinking switch, requested budget, neutral effort); the budget is raw, possibly above 2**31-1."""
    config = f.optional_object(body, "thinking")
    enabled, budget = None, None
    if config is not None:
        kind = config.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise RequestError("thinking.type must be enabled, adaptive or disabled", "thinking")
        enabled = kind != "disabled"
        if enabled:
            budget = config.get("budget_tokens")
            if (budget is None and kind == "enabled") or (
                budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1)
            ):
                raise RequestError(
                    "thinking.budget_tokens must be a positive integer (required when enabled)",
                    "thinking.budget_tokens",
                )
    top = f.optional_int(body, "thinking_token_budget", 1, MAX_APPLIED_BUDGET)
    if top is not None and budget is not None and top != budget:
        raise RequestError(
            f"thinking_token_budget ({top}) and thinking.budget_tokens ({budget}) must match", "thinking_token_budget"
        )
    budget = budget if budget is not None else top
    output_config = f.optional_object(body, "output_config") or {}
    effort = output_config.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise RequestError(
            f"output_config.effort must be a named level ({', '.join(EFFORTS)}); numeric scores are "
            f"not accepted (got {effort!r})",
            "output_config.effort",
        )
    if effort is None and budget is not None:
        effort = "low" if budget <= 5000 else "high" if budget <= 20000 else "max"
    return enabled, budget, effort


def _context_management(body: dict[str, Any]) -> None:
    config = f.optional_object(body, "context_management") or {}
    edits = config.get("edits") or []
    if not isinstance(edits, list):
        raise RequestError("context_management.edits must be an array", "context_management")
    for edit in edits:
        if not isinstance(edit, dict) or edit.get("type") != "clear_thinking_20251015" or edit.get("keep") != "all":
            raise RequestError(
                "only clear_thinking_20251015 with keep: all is supported; active context edits are rejected",
                "context_management",
            )


Thinking = tuple[bool | None, int | None, str | None]  # (thinking switch, requested budget, neutral effort)


def _conversation(body: dict[str, Any]) -> tuple[Conversation, Thinking]:
    f.model(body)
    messages, marks = _messages(body)
    tools, choice = _tools(body)
    thinking = _thinking(body)
    _context_management(body)
    prefill = bool(messages) and messages[-1].role == "assistant"
    conversation = Conversation(
        tuple(messages),
        tools,
        choice,
        thinking=thinking[0],
        effort=thinking[2],
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        template_kwargs=f.optional_object(body, "chat_template_kwargs") or {},
        cache_marks=tuple(marks),
    )
    return conversation, thinking


def decode(body: dict[str, Any], *, headers_version: str | None) -> tuple[InferenceRequest, MessagesOptions]:
    _check_version(headers_version)
    f.reject(body, UNSUPPORTED)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens is required and must be a positive integer", "max_tokens")
    conversation, (enabled, budget, effort) = _conversation(body)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or any(not isinstance(s, str) for s in stops)):
        raise RequestError("stop_sequences must be an array of strings", "stop_sequences")
    stream = f.optional_bool(body, "stream")
    explicit = body.get("thinking_token_budget") is not None
    request = InferenceRequest(
        input=conversation,
        sampling=f.sampling(body),
        max_tokens=max_tokens,
        n=1,
        stop=f.stop_options(body, tuple(stops or ())),  # with the native token stops and ignore_eos
        stream=stream,
        thinking_token_budget=budget if budget is not None and budget <= MAX_APPLIED_BUDGET else None,
        output=messages_output_format(body, f.optional_object(body, "output_config") or {}),
        cache_salt=f.cache_salt(body),
        budget_is_hint=not explicit,  # thinking.budget_tokens alone caps only where the model can
        uncapped_reasoning=budget is not None and budget > MAX_APPLIED_BUDGET,
    )
    options = MessagesOptions(body["model"], stream, enabled, budget, effort, explicit_budget=explicit)
    return request, options


def count_tokens_decode(
    body: dict[str, Any], headers_version: str | None
) -> tuple[Conversation, OutputConstraint | None]:
    """The conversation a count_tokens body describes, and its output format (whose JSON
    instruction is part of the prompt); other generation fields are ignored."""
    _check_version(headers_version)
    return _conversation(body)[0], messages_output_format(body, f.optional_object(body, "output_config") or {})


# ---------------------------------------------------------------------------- encoding
EMPTY_BLOCKS = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
STOP_REASONS = {
    Termination.LENGTH: "max_tokens",
    Termination.TOOL_CALLS: "tool_use",
    Termination.STOP_STRING: "stop_sequence",
}


def stop_reason(finish: FinishEvent) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence); every other cause, aborts included, is end_turn."""
    reason = STOP_REASONS.get(finish.termination, "end_turn")
    return reason, finish.matched_stop if reason == "stop_sequence" else None


def usage_json(usage: Usage) -> dict[str, Any]:
    """Reused prompt tokens are cache reads; the rest are input (their sum is count_tokens').
    Image requests add multimodal_tokens.image: image feature tokens within that sum."""
    body: dict[str, Any] = {
        "input_tokens": max(usage.prompt_tokens - usage.cached_tokens, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }
    if usage.image_tokens:
        body["multimodal_tokens"] = {"image": usage.image_tokens}
    return body


def _tool_use(call: ToolCallEvent, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": arguments}


def message_json(message_id: str, model: str, acc: Accumulator, usage: Usage) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for block in acc.blocks:
        if block.kind == "reasoning" and block.text:
            content.append({"type": "thinking", "thinking": block.text, "signature": thinking_signature(block.text)})
        elif block.kind == "text" and block.text:
            content.append({"type": "text", "text": block.text})
        elif block.call is not None:
            content.append(_tool_use(block.call, json.loads(block.call.arguments or "{}")))
    reason, sequence = stop_reason(acc.finish or FinishEvent(Termination.EOS))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(usage),
    }


def sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


Events = list[tuple[str, dict[str, Any]]]  # (SSE event name, data with its "type")


class MessagesStream:
    """Named SSE events for one message: blocks open on their first nonempty event and close
    when another kind starts or the message finishes; thinking closes with its signature."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, image_tokens: int = 0) -> None:
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.image_tokens = image_tokens  # image feature tokens within prompt_tokens
        self._index = -1  # index of the latest block
        self._open: str | None = None  # "text" | "thinking" while a block is open
        self._thinking = ""  # the open thinking block's text, for its signature

    def start(self) -> Events:
        usage = {
            "input_tokens": self.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
        if self.image_tokens:
            usage["multimodal_tokens"] = {"image": self.image_tokens}
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def push(self, events: list[SemanticEvent]) -> Events:
        out: Events = []
        for event in events:
            if isinstance(event, (TextEvent, ReasoningEvent)) and event.text:
                kind = "text" if isinstance(event, TextEvent) else "thinking"
                if self._open != kind:
                    out += self._close()
                    out.append(self._opened(kind, dict(EMPTY_BLOCKS[kind])))
                delta = (
                    {"type": "text_delta", "text": event.text}
                    if kind == "text"
                    else {"type": "thinking_delta", "thinking": event.text}
                )
                self._thinking += event.text if kind == "thinking" else ""
                out.append(self._event("content_block_delta", delta=delta))
            elif isinstance(event, ToolCallEvent):
                out += self._close()
                out.append(self._opened("tool_use", _tool_use(event, {})))
                delta = {"type": "input_json_delta", "partial_json": event.arguments}  # complete: parsers buffer calls
                out.append(self._event("content_block_delta", delta=delta))
                out += self._close()
            elif isinstance(event, FinishEvent):
                out += self._close()
        return out

    def finish(self, finish: FinishEvent, usage: Usage) -> Events:
        reason, sequence = stop_reason(finish)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_json(usage),
        }
        return self._close() + [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def error(self, status: int, message: str) -> Events:
        return [("error", anthropic_error(status, message))]

    def _event(self, name: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return name, {"type": name, "index": self._index, **fields}

    def _opened(self, kind: str, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._index += 1
        self._open, self._thinking = kind, ""
        return self._event("content_block_start", content_block=block)

    def _close(self) -> Events:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": thinking_signature(self._thinking)}
            out.append(self._event("content_block_delta", delta=delta))
        self._open = None
        return out + [self._event("content_block_stop")]
