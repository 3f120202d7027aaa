"""Lowering a request's input into prompt token ids: the chat template (sandboxed Jinja) or the
core's native encoder, tool declarations and instructions, reasoning options, and images.

The functions read the loaded core's services from the `Frontend` facade (helios/frontend/request.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from helios.core.template import TemplateError, check_template_kwargs
from helios.engine import EngineImage
from helios.frontend.checkpoints import Rendering, character_hints, token_hints
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    Message,
    OutputConstraint,
    RawPrompt,
    RequestError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from helios.frontend.prompt_images import TEXT_ONLY_IMAGES, ImageRejected, message_images

if TYPE_CHECKING:
    from helios.frontend.request import Frontend

EFFORT_ORDER = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
EFFORT_VARIABLES = ("reasoning_effort", "thinking_effort")  # Qwen 3.8 and GLM-5.3; Kimi K3
REQUIRED_TOOL_INSTRUCTION = "You must answer by calling at least one of the provided tools."
JSON_OBJECT_INSTRUCTION = "Respond with only a JSON object, and no other text."
JSON_SCHEMA_INSTRUCTION = "Respond with only a JSON value that conforms to this JSON schema, and no other text:\n"


def output_instruction(output: OutputConstraint | None) -> str | None:
    """The system-prompt instruction for conversational JSON output (grammars get none)."""
    if output is None or output.kind not in ("json_schema", "json_object"):
        return None
    return JSON_SCHEMA_INSTRUCTION + output.definition if output.kind == "json_schema" else JSON_OBJECT_INSTRUCTION


def normalize_tool_results(messages: list[Message]) -> list[Message]:
    """Parallel tool results go back into the preceding assistant's call order (api.md).

    The group is every tool message after an assistant message with calls, up to the next
    assistant message; other messages among them keep their positions, and the tool messages
    take theirs in call order. A group whose ids are missing, duplicated or unknown stays exactly
    as supplied; results never move across another assistant message.
    """
    out = list(messages)
    for index, message in enumerate(out):
        calls = [p.call_id for p in message.parts if isinstance(p, ToolCallPart)] if message.role == "assistant" else []
        if len(calls) < 2:
            continue
        end = next((i for i in range(index + 1, len(out)) if out[i].role == "assistant"), len(out))
        slots = [i for i in range(index + 1, end) if out[i].role == "tool"]
        ids = [next((p.call_id for p in out[i].parts if isinstance(p, ToolResultPart)), None) for i in slots]
        if sorted(ids, key=str) != sorted(calls, key=str) or len(set(calls)) != len(calls):
            continue  # missing, duplicate or unknown ids: left as supplied
        results = dict(zip(ids, (out[i] for i in slots), strict=True))
        for slot, call_id in zip(slots, calls, strict=True):
            out[slot] = results[call_id]
    return out


def nearest_effort(level: str, accepted: tuple[str, ...]) -> str:
    """A neutral effort level resolved against the template's vocabulary (closest rank)."""
    if level in accepted:
        return level
    if level not in EFFORT_ORDER:
        raise RequestError(f"unknown reasoning effort {level!r} (accepted: {', '.join(accepted)})", "effort")
    rank = EFFORT_ORDER.index(level)
    ranked = [a for a in accepted if a in EFFORT_ORDER]
    return (
        min(ranked, key=lambda a: (abs(EFFORT_ORDER.index(a) - rank), -EFFORT_ORDER.index(a)))
        if ranked
        else accepted[0]
    )


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """One input lowered into the tokens the engine prefills."""

    token_ids: tuple[int, ...]  # nonempty, inside the vocabulary (image tokens included)
    text: str | None  # rendered chat text or the raw prompt text (None for token-id prompts)
    checkpoint_hints: tuple[tuple[int, str], ...] = ()  # EngineRequest.checkpoint_hints (frontend/checkpoints.py)
    images: tuple[EngineImage, ...] = ()  # EngineRequest.images: each image's token span, in prompt order

    @property
    def image_tokens(self) -> int:
        """Image feature tokens in the prompt (usage multimodal_tokens.image; framing excluded)."""
        return sum(image.num_tokens for image in self.images)

    @property
    def image_positions(self) -> frozenset[int]:
        """Prompt positions filled by image features (their prompt logprobs are null)."""
        return frozenset(p for image in self.images for p in range(image.start, image.end) if image.covers(p))


def prompt(fe: Frontend, source: Conversation | RawPrompt, output: OutputConstraint | None = None) -> PreparedPrompt:
    """The prompt's token ids: a conversation through the chat template (or the native encoder), a
    raw prompt tokenized as it is. Refused from counts alone first, before any rendering."""
    fe.bounds.check(source)
    if isinstance(source, RawPrompt):
        return _raw_prompt(fe, source)
    if source.tools and source.tool_choice.mode in ("required", "named") and not fe.manifest.recipe.tool_syntax:
        raise RequestError(
            f"tool_choice {source.tool_choice.mode!r} needs a tool call, but this model's recipe "
            f"({fe.manifest.recipe.name}) declares no tool-call syntax: use tool_choice auto or none",
            "tool_choice",
        )
    if fe.native is not None:
        messages, presented = lowered(fe, source, output, native=True)
        ids, text = fe.native.encode(source, messages, presented, reasoning_kwargs(fe, source), output)
        return PreparedPrompt(ids, text)
    return _templated_prompt(fe, source, output)


def _templated_prompt(fe: Frontend, source: Conversation, output: OutputConstraint | None) -> PreparedPrompt:
    """Client text's control-token strings stay plain text (literal_text.py); images expand into
    their token layout, and checkpoint hints move with them."""
    rendered: list[tuple[Conversation, Rendering]] = []

    def render_text(conversation: Conversation) -> str:
        rendered.append((conversation, rendering(fe, conversation, output)))
        return rendered[-1][1].text

    pictures = fe.images.check(message_images(lowered(fe, source, output)[0])) if fe.vision else []
    encoded = fe.literal.encode_conversation(source, render_text)
    hints: tuple[tuple[int, str], ...] = ()
    if fe.checkpoint_hints or fe.anchor_hints:
        conversation, encoded_rendering = rendered[-1]  # the one whose text was encoded (placeholders and all)
        marks = [(conversation.messages[i], j) for i, j in source.cache_marks if 0 <= i < len(conversation.messages)]
        found = character_hints(encoded_rendering, marks, anchor_only=not fe.checkpoint_hints)
        hints = token_hints(found, encoded.spans)
    if not pictures:
        return PreparedPrompt(tuple(encoded.ids), encoded.text, hints)
    ids, spans = fe.images.expand(list(encoded.ids), [cost for _, _, cost in pictures])
    growth = [(old, grown) for old, _, grown, _ in spans]
    hints = tuple((fe.images.shifted(pos, growth), role) for pos, role in hints)
    engine_images = tuple(
        fe.images.engine_image(part, header, cost, start, runs)
        for (part, header, cost), (_, start, _, runs) in zip(pictures, spans)
    )
    return PreparedPrompt(tuple(ids), encoded.text, hints, engine_images)


def _raw_prompt(fe: Frontend, source: RawPrompt) -> PreparedPrompt:
    """Explicit ids are kept as they are; text gets the tokenizer's special-token policy."""
    if source.token_ids is not None:
        if not source.token_ids:
            raise RequestError("a token-id prompt must not be empty", "prompt")
        bad = [t for t in source.token_ids if not 0 <= t < fe.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {fe.vocab_size})", "prompt")
        return PreparedPrompt(tuple(source.token_ids), None)
    text = source.text or ""
    ids = tuple(fe.tokenizer.encode(text, add_special_tokens=True).ids)
    if not ids:
        bos = fe.manifest.tokenizer.bos_token_id
        if bos is None:
            raise RequestError("an empty prompt needs a BOS token, and this model has none", "prompt")
        ids = (bos,)
    return PreparedPrompt(ids, text)


# ---------------------------------------------------------------------------- the chat template
def render(fe: Frontend, conversation: Conversation, output: OutputConstraint | None = None) -> str:
    """The conversation's prompt text through the chat template."""
    return rendering(fe, conversation, output).text


def rendering(fe: Frontend, conversation: Conversation, output: OutputConstraint | None) -> Rendering:
    """The rendered text with what checkpoint hints need (the template messages, a prefix renderer)."""
    template = fe.template
    if template is None:
        raise RequestError("this model has no chat template; use /v1/completions with a raw prompt", "messages")
    arranged, presented = lowered(fe, conversation, output)
    messages = [template_message(fe, m) for m in arranged]
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in presented
    ] or None
    effort_name = effort_variable(template.source)
    default_effort = fe.manifest.recipe.default_effort if effort_name else None
    kwargs = reasoning_kwargs(fe, conversation, effort_name or "reasoning_effort", default_effort)
    try:
        check_template_kwargs(kwargs)
        text = template.render(
            messages,
            tools=tools,
            add_generation_prompt=conversation.add_generation_prompt,
            continue_final_message=conversation.continue_final_message,
            **kwargs,
        )
    except TemplateError as exc:
        raise RequestError(str(exc), "messages") from None
    return Rendering(
        text,
        arranged,
        messages,
        lambda prefix: template.render(prefix, tools=tools, add_generation_prompt=False, **kwargs),
        tools is not None,
    )


def lowered(
    fe: Frontend, conversation: Conversation, output: OutputConstraint | None, native: bool = False
) -> tuple[list[Message], list[ToolSpec]]:
    """The arranged messages and the tools presented to the model. A native encoder writes its
    own required-call and response-format prompts, so it gets no added instructions."""
    choice = conversation.tool_choice
    presented = [t for t in conversation.tools if choice.mode != "named" or t.name == choice.name]
    if choice.mode == "none":
        presented = []
    arranged = arrange(fe, conversation.messages)
    if choice.mode == "required" and not native:
        arranged = with_instruction(arranged, REQUIRED_TOOL_INSTRUCTION)
    instruction = None if native else output_instruction(output)
    if instruction is not None:
        arranged = with_instruction(arranged, instruction)
    return normalize_tool_results(arranged), presented


def reasoning_kwargs(
    fe: Frontend, conversation: Conversation, effort_name: str = "reasoning_effort", default_effort: str | None = None
) -> dict[str, object]:
    """Template variables for reasoning controls; explicit chat_template_kwargs win. The effort
    goes under `effort_name`; `default_effort` stands in where the request names none."""
    kwargs = dict(conversation.template_kwargs)
    if conversation.thinking is not None:  # Messages' thinking switch; templates without it ignore it
        kwargs.setdefault("enable_thinking", conversation.thinking)
    levels = fe.manifest.recipe.effort_levels
    effort = nearest_effort(conversation.effort, levels) if conversation.effort is not None and levels else None
    if effort or default_effort:
        kwargs.setdefault(effort_name, effort or default_effort)
    return kwargs


@functools.lru_cache(maxsize=16)
def effort_variable(source: str) -> str | None:
    """The reasoning-effort variable a chat template reads (Kimi K3: thinking_effort), or None."""
    return next((name for name in EFFORT_VARIABLES if re.search(rf"\b{name}\b", source)), None)


def with_instruction(messages: list[Message], text: str) -> list[Message]:
    """Append an instruction to the leading system message (creating one if needed)."""
    if messages and messages[0].role == "system":
        lead = messages[0]
        return [Message("system", (TextPart(f"{lead.text()}\n\n{text}" if lead.text() else text),))] + messages[1:]
    return [Message("system", (TextPart(text),))] + messages


def arrange(fe: Frontend, messages: tuple[Message, ...]) -> list[Message]:
    """System/developer merging and the inline-system fallback (spec: conversation semantics)."""
    if any(m.role == "developer" for m in messages):
        sections = [m for m in messages if m.role in ("system", "developer")]
        merged = "\n\n".join(f"{m.role}:\n{m.text()}" for m in sections if m.text())
        rest = [m for m in messages if m.role not in ("system", "developer")]
        return ([Message("system", (TextPart(merged),))] if merged else []) + rest
    arranged: list[Message] = []
    inline = None
    for index, message in enumerate(messages):
        if message.role == "system" and not message.text():
            continue  # empty system messages produce no prompt text
        if message.role == "system" and index > 0 and any(m.role != "system" for m in messages[:index]):
            if inline is None:
                renderer = fe.native or fe.template
                inline = renderer.supports_inline_system() if renderer else False
            if not inline:
                message = Message("user", (TextPart(f"<system>{message.text()}</system>"),))
        arranged.append(message)
    return arranged


def template_message(fe: Frontend, message: Message) -> dict[str, object]:
    """One message as HF chat templates read it: content (a string, or text and image items),
    tool_calls with parsed arguments, reasoning_content, tool_call_id."""
    out: dict[str, object] = {"role": message.role}
    texts, calls = [], []
    items: list[dict[str, str]] = []
    vision = fe.vision is not None
    for part in message.parts:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, ToolCallPart):
            try:
                arguments = json.loads(part.arguments) if part.arguments else {}
            except json.JSONDecodeError:
                raise RequestError(f"tool call {part.call_id!r} arguments are not valid JSON", "messages") from None
            calls.append(
                {"id": part.call_id, "type": "function", "function": {"name": part.name, "arguments": arguments}}
            )
        elif isinstance(part, ToolResultPart):
            out["tool_call_id"] = part.call_id
            if any(isinstance(p, ImagePart) for p in part.content) and not vision:
                raise ImageRejected(f"{TEXT_ONLY_IMAGES}: tool result {part.call_id!r} carries one", "messages")
            result = "\n\n".join(p.text for p in part.content if isinstance(p, TextPart))
            if part.is_error:  # templates render no flag for it: say it in the result the model reads
                out["is_error"] = True
                result = f"Error: {result}" if result else "Error"
            texts += [result] if result else []
            items += [{"type": "text", "text": result}] if result else []
            items += [{"type": "image"} for p in part.content if isinstance(p, ImagePart)]
            continue
        elif isinstance(part, ImagePart):
            if not vision:
                raise ImageRejected(TEXT_ONLY_IMAGES, "messages")
            items.append({"type": "image"})
            continue
        if isinstance(part, TextPart):
            items.append({"type": "text", "text": part.text})
    # With images, the content is the template's list of text and image items, in order.
    out["content"] = items if any(i["type"] == "image" for i in items) else "\n\n".join(texts)
    if calls:
        out["tool_calls"] = calls
    reasoning = message.reasoning()
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.name:
        out["name"] = message.name
    return out
