"""OpenAI Chat Completions: wire JSON -> neutral request (encoding: openai_chat_encoding.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from helios.frontend.inference import (
    Conversation,
    ImagePart,
    InferenceRequest,
    Message,
    Part,
    ReasoningPart,
    RequestError,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    ToolSpec,
)
from helios.protocols import fields as f
from helios.protocols.openai_common import OpenAIOptions
from helios.protocols.output_format import chat_response_format

UNSUPPORTED = ("audio", "prediction", "web_search_options", "functions", "function_call", "suffix")
ROLES = ("system", "developer", "user", "assistant", "tool")
REQUIRES = "logprobs: true"  # what turns generation logprobs on


@dataclass(frozen=True, slots=True)
class ChatOptions(OpenAIOptions):
    """Protocol-level options that do not reach the engine."""

    logprobs: bool  # render logprobs.content
    return_token_ids: bool = False  # choices (and chunks) carry their generated token ids
    return_token_timestamps: bool = False  # ... and the Unix time each token reached the frontend

    @property
    def observes_tokens(self) -> bool:
        """A token observation extension is on: terminal chunks then carry usage (spec)."""
        return self.return_token_ids or self.return_token_timestamps


def _image(part: dict[str, Any]) -> ImagePart:
    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
    return f.data_url_image(url, "messages", "images must be base64 data URLs (remote image downloads are unsupported)")


def _content_parts(content: Any, role: str) -> tuple[Part, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list):
        raise RequestError(f"{role} message content must be a string or an array of parts", "messages")
    parts: list[Part] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(TextPart(part["text"]))
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(TextPart(part["refusal"]))
        elif kind == "image_url":
            parts.append(_image(part))
        else:
            raise RequestError(f"unsupported content part type {kind!r} in a {role} message", "messages")
    return tuple(parts)


def _message(raw: Any) -> Message:
    if not isinstance(raw, dict) or raw.get("role") not in ROLES:
        role = raw.get("role") if isinstance(raw, dict) else None
        raise RequestError(f"each message needs a role among {', '.join(ROLES)} (got {role!r})", "messages")
    role = raw["role"]
    parts = list(_content_parts(raw.get("content"), role))
    if role == "assistant":
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            parts.insert(0, ReasoningPart(reasoning))
        for call in raw.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError("assistant tool_calls entries need function.name", "messages")
            arguments = fn.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            parts.append(ToolCallPart(str(call.get("id", "")), fn["name"], arguments))
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError("tool messages need a tool_call_id", "messages")
        parts = [ToolResultPart(call_id, tuple(p for p in parts if isinstance(p, (TextPart, ImagePart))))]
    name = raw.get("name") if isinstance(raw.get("name"), str) else None
    return Message(role, tuple(parts), name)


def _tools(body: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice]:
    specs = []
    for tool in f.tools(body):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError("each tool must be {type: function, function: {name, parameters}}", "tools")
        if fn.get("strict") is True:
            raise RequestError("strict function schemas are not supported", "tools")
        specs.append(ToolSpec(fn["name"], fn.get("description"), fn.get("parameters") or {"type": "object"}))
    parallel = f.optional_bool(body, "parallel_tool_calls", default=True)
    return tuple(specs), f.tool_choice(body.get("tool_choice"), specs, parallel, lambda c: _named_tool(c, specs))


def _named_tool(choice: Any, specs: list[ToolSpec]) -> str:
    """{type: function, function: {name}}: the declared function tool it names."""
    name = (
        (choice.get("function") or {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    if not isinstance(name, str):
        raise RequestError(
            'tool_choice must be "auto", "none", "required" or {type: function, function: {name}}', "tool_choice"
        )
    if name not in {s.name for s in specs}:
        raise RequestError(f"tool_choice names {name!r}, which is not a declared function tool", "tool_choice")
    return name


def _reasoning_effort(value: Any) -> str | int | None:
    """A named level or an integer score; the prepared template or native encoder validates it."""
    if value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise RequestError(
        f"reasoning_effort must be a named level or an integer score (got {value!r})", "reasoning_effort"
    )


def decode(body: dict[str, Any]) -> tuple[InferenceRequest, ChatOptions]:
    f.reject(body, UNSUPPORTED)
    model = f.model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a nonempty array", "messages")
    output = chat_response_format(f.optional_object(body, "response_format"))
    max_tokens = f.optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = f.optional_int(body, "max_tokens", 1)
    logprobs = f.optional_bool(body, "logprobs")
    generation_logprobs = f.logprob_options(body, f.top_logprobs(body, logprobs, REQUIRES), REQUIRES)
    stream = f.optional_bool(body, "stream")
    prompt_logprobs = f.optional_int(body, "prompt_logprobs", 0, 20)
    if stream and body.get("prompt_logprobs") is not None:
        raise RequestError("prompt_logprobs cannot be streamed", "prompt_logprobs")
    include_usage, continuous = f.stream_usage(body, stream)
    template_kwargs = f.optional_object(body, "chat_template_kwargs") or {}
    if "reasoning_effort" in body:  # the native template option; chat_template_kwargs wins
        template_kwargs = {"reasoning_effort": _reasoning_effort(body["reasoning_effort"]), **template_kwargs}
    continue_final = f.optional_bool(body, "continue_final_message")
    add_generation = f.optional_bool(body, "add_generation_prompt", default=not continue_final)
    tools, tool_choice = _tools(body)
    conversation = Conversation(
        messages=tuple(_message(m) for m in messages),
        tools=tools,
        tool_choice=tool_choice,
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
        template_kwargs=template_kwargs,
    )
    stop = f.stop_options(body)
    request = InferenceRequest(
        input=conversation,
        sampling=f.sampling(body),
        max_tokens=max_tokens,
        n=f.optional_int(body, "n", 1, 128) or 1,
        stop=stop,
        logprobs=replace(generation_logprobs, prompt=prompt_logprobs),
        stream=stream,
        thinking_token_budget=f.thinking_token_budget(body),
        output=output,
        cache_salt=f.cache_salt(body),
    )
    options = ChatOptions(
        model=model,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=logprobs,
        return_token_ids=f.optional_bool(body, "return_token_ids"),
        return_token_timestamps=f.optional_bool(body, "return_token_timestamps"),
    )
    return request, options
