"""Responses request decoding: wire JSON -> neutral InferenceRequest plus ResponsesOptions.

Custom tools are presented to the model as {"input": string} functions (with their grammar
contract in the description); namespaced tools are presented as "namespace__name".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from helios.frontend.grammar import CompiledGrammar, GrammarError, compile_grammar
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    InferenceRequest,
    LogprobOptions,
    Message,
    Part,
    ReasoningPart,
    RequestError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from helios.frontend.prompt import EFFORT_ORDER
from helios.protocols import fields as f
from helios.protocols.output_format import responses_text_format

UNSUPPORTED = ("previous_response_id", "conversation", "prompt", "prompt_logprobs")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
GrammarCompiler = Callable[[str, str, str], CompiledGrammar]  # (syntax, definition, field); GrammarError on failure


@dataclass(frozen=True, slots=True)
class ResponsesOptions:
    """Protocol-level options: echoes for the response object and the output mapping."""

    model: str
    stream: bool
    logprobs: bool  # include has message.output_text.logprobs
    top_logprobs: int  # 0..20
    tools_echo: list[dict[str, Any]]  # the tools as sent, with schema-required defaults filled in
    tool_choice_echo: Any  # as sent ("auto" when omitted)
    instructions: str | None
    custom_tools: Mapping[str, CompiledGrammar | None] = field(default_factory=dict)  # presented name -> grammar
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # presented name -> (namespace, name)
    parallel_tool_calls: bool = True
    temperature: float | None = None  # echoed as sent (the shared resolver clamps the value used)
    top_p: float | None = None
    max_output_tokens: int | None = None
    reasoning_effort: str | None = None
    metadata: dict[str, Any] | None = None
    # text.format as echoed: JSON formats as sent; the native grammar extension echoes as text (OpenAI's schema)
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})


# ---------------------------------------------------------------------------- input items
def _image(url: Any, param: str) -> ImagePart:
    return f.data_url_image(
        url, param, "input_image needs a base64 data URL in image_url (file_id and remote URLs are unsupported)"
    )


def _parts(content: Any, param: str) -> tuple[TextPart | ImagePart, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list):
        raise RequestError("content must be a string or an array of content parts", param)
    parts: list[TextPart | ImagePart] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "refusal") and isinstance(text, str):
            parts.append(TextPart(text))
        elif kind == "input_image":
            parts.append(_image(part.get("image_url"), param))
        else:
            raise RequestError(f"unsupported content part type {kind!r}", param)
    return tuple(parts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key in ("call_id", "name") and not value):
        raise RequestError(f"{item.get('type')} items need a string {key}", param)
    return value


def _presented(item: dict[str, Any], param: str) -> str:
    name = _string(item, "name", param)
    namespace = item.get("namespace")
    return f"{namespace}__{name}" if isinstance(namespace, str) and namespace else name


def _reasoning_text(item: dict[str, Any], param: str) -> str | None:
    texts = [p.get("text") for p in item.get("content") or [] if isinstance(p, dict)]
    if not any(isinstance(t, str) and t for t in texts):  # a summary is readable reasoning too
        texts = [p.get("text") for p in item.get("summary") or [] if isinstance(p, dict)]
    text = "\n\n".join(t for t in texts if isinstance(t, str) and t)
    if not text and item.get("encrypted_content"):
        raise RequestError("opaque encrypted reasoning is not supported (send readable reasoning_text content)", param)
    return text or None


def _messages(value: Any) -> list[Message]:
    """Input items as conversation messages; assistant-side items between inputs form one turn."""
    if isinstance(value, str):
        return [Message("user", (TextPart(value),))]
    if not isinstance(value, list) or not value:
        raise RequestError("input must be a string or a nonempty array of items", "input")
    messages: list[Message] = []
    turn: list[Part] = []  # the pending assistant turn: reasoning, text and calls in order

    def flush() -> None:
        if turn:
            messages.append(Message("assistant", tuple(turn)))
            turn.clear()

    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError("each input item must be an object", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"message role must be user, system, developer or assistant (got {role!r})", param)
            parts = _parts(item.get("content"), param)
            if role == "assistant":
                turn.extend(parts)
                continue
            flush()
            messages.append(Message(role, parts))
        elif kind == "reasoning":
            text = _reasoning_text(item, param)
            if text is not None:
                turn.append(ReasoningPart(text))
        elif kind == "function_call":
            turn.append(
                ToolCallPart(
                    _string(item, "call_id", param), _presented(item, param), _string(item, "arguments", param)
                )
            )
        elif kind == "custom_tool_call":
            arguments = json.dumps({"input": _string(item, "input", param)}, ensure_ascii=False)
            turn.append(ToolCallPart(_string(item, "call_id", param), _presented(item, param), arguments))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            flush()
            result = ToolResultPart(_string(item, "call_id", param), _parts(item.get("output"), param))
            messages.append(Message("tool", (result,)))
        else:
            raise RequestError(
                f"input item type {kind!r} is not supported (stateless Responses accept messages, "
                "reasoning, and function or custom tool calls and outputs)",
                param,
            )
    flush()
    return messages


# ---------------------------------------------------------------------------- tools
def _custom_description(base: str | None, grammar: CompiledGrammar | None) -> str:
    contract = "Put the tool's complete raw text input in the `input` string."
    if grammar is not None:
        language = "Lark grammar" if grammar.syntax == "lark" else "regular expression"
        contract += f" The whole input must match this {language} exactly:\n{grammar.definition}"
    return f"{base}\n\n{contract}" if base else contract


def _tool(tool: Any, param: str, namespace: tuple[str, str] | None, grammars: GrammarCompiler) -> ToolSpec:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind not in ("function", "custom"):
        raise RequestError(
            f"tool type {kind!r} is not supported (hosted tools are unavailable; use function, custom "
            "or namespace tools)",
            param,
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{kind} tools need a nonempty name", param)
    presented = f"{namespace[0]}__{name}" if namespace else name
    description = tool.get("description") if isinstance(tool.get("description"), str) else None
    if namespace and namespace[1]:
        description = f"{description}\n\n(Namespace {namespace[0]}: {namespace[1]})" if description else namespace[1]
    if kind == "function":
        if tool.get("strict") is True:
            raise RequestError("strict function schemas are not supported", param)
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError("function parameters must be a JSON schema object", param)
        return ToolSpec(presented, description, parameters or {"type": "object", "properties": {}})
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise RequestError(
            "custom tool format must be {type: text} or {type: grammar, syntax, definition}", f"{param}.format"
        )
    grammar = None
    if fmt["type"] == "grammar":
        try:
            grammar = grammars(str(fmt.get("syntax")), fmt.get("definition"), f"{param}.format")
        except GrammarError as exc:
            raise RequestError(exc.message, exc.field) from None
    return ToolSpec(
        presented, _custom_description(description, grammar), CUSTOM_PARAMETERS, kind="custom", grammar=grammar
    )


def _tools(body: dict[str, Any], grammars: GrammarCompiler) -> tuple[list[ToolSpec], dict[str, tuple[str, str]]]:
    """Tool specs as presented to the model, and presented name -> (namespace, name)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError("tools must be an array", "tools")
    specs: list[tuple[ToolSpec, str]] = []
    namespaces: dict[str, tuple[str, str]] = {}
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            space, members = tool.get("name"), tool.get("tools")
            if not isinstance(space, str) or not space or not isinstance(members, list) or not members:
                raise RequestError("namespace tools need a nonempty name and a nonempty tools array", param)
            about = tool.get("description") if isinstance(tool.get("description"), str) else ""
            for position, member in enumerate(members):
                spec = _tool(member, f"{param}.tools[{position}]", (space, about), grammars)
                specs.append((spec, f"{param}.tools[{position}]"))
                namespaces[spec.name] = (space, member["name"])
        else:
            specs.append((_tool(tool, param, None, grammars), param))
    seen: set[str] = set()
    for spec, param in specs:
        if spec.name in seen:
            raise RequestError(
                f"tool name {spec.name!r} is ambiguous (namespaced tools are presented as "
                "namespace__name, and names must be unique)",
                param,
            )
        seen.add(spec.name)
    return [spec for spec, _ in specs], namespaces


def _echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as sent, with the fields the response schema requires."""
    if tool.get("type") == "function":
        return {"strict": None, "parameters": None, **tool}
    if tool.get("type") == "namespace":
        return {**tool, "description": tool.get("description") or "", "tools": [_echo(t) for t in tool["tools"]]}
    return dict(tool)


def _named_tool(value: Any, specs: list[ToolSpec]) -> str:
    """{type: function, name} or {type: custom, name}: the declared tool of that kind it names."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("function", "custom") or not isinstance(value.get("name"), str):
        raise RequestError(
            'tool_choice must be "auto", "none", "required", {type: function, name} or {type: custom, name}',
            "tool_choice",
        )
    if {spec.name: spec.kind for spec in specs}.get(value["name"]) != kind:
        raise RequestError(
            f"tool_choice selects {kind} tool {value['name']!r}, which is not declared as a {kind} tool", "tool_choice"
        )
    return value["name"]


# ---------------------------------------------------------------------------- request
def _reject_state(body: dict[str, Any]) -> None:
    f.reject(body, UNSUPPORTED, "is not supported (Responses are stateless: send the whole conversation)")
    if f.optional_bool(body, "store"):
        raise RequestError("store: true is not supported (Responses are stateless; nothing is stored)", "store")
    if f.optional_bool(body, "background"):
        raise RequestError("background responses are not supported", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError('truncation must be "disabled" (automatic truncation is not supported)', "truncation")


def _effort(body: dict[str, Any]) -> str | None:
    effort = (f.optional_object(body, "reasoning") or {}).get("effort")
    if effort is not None and effort not in EFFORT_ORDER:
        raise RequestError(
            f"reasoning.effort must be a named level ({', '.join(EFFORT_ORDER)}), got {effort!r}", "reasoning.effort"
        )
    return effort


def _logprobs(body: dict[str, Any]) -> tuple[bool, int, LogprobOptions]:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise RequestError("include must be an array of strings", "include")
    logprobs = LOGPROBS_INCLUDE in include  # other include values are ignored
    requires = f'include: ["{LOGPROBS_INCLUDE}"]'
    options = f.logprob_options(body, f.top_logprobs(body, logprobs, requires), requires)
    return logprobs, options.top or 0, options


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)  # echoed only; the shared resolver checks and clamps it
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def decode(
    body: dict[str, Any], grammars: GrammarCompiler = compile_grammar
) -> tuple[InferenceRequest, ResponsesOptions]:
    """The neutral request and options; `grammars` compiles custom-tool grammars (the server
    passes its cached, bounded compiler; this runs on the frontend pool)."""
    _reject_state(body)
    model = f.model(body)
    fmt = (f.optional_object(body, "text") or {}).get("format")
    output = responses_text_format(fmt)
    instructions = f.optional_str(body, "instructions")
    messages = _messages(body.get("input"))
    if instructions:
        messages.insert(0, Message("developer", (TextPart(instructions),)))  # merged with other instruction text
    specs, namespaces = _tools(body, grammars)
    parallel = f.optional_bool(body, "parallel_tool_calls", default=True)
    logprobs, top, logprob_options = _logprobs(body)
    effort = _effort(body)
    stream = f.optional_bool(body, "stream")
    conversation = Conversation(
        messages=tuple(messages),
        tools=tuple(specs),
        tool_choice=f.tool_choice(body.get("tool_choice"), specs, parallel, lambda c: _named_tool(c, specs)),
        effort=effort,
        template_kwargs=f.optional_object(body, "chat_template_kwargs") or {},
    )
    stop = f.stop_options(body)
    max_tokens = f.optional_int(body, "max_output_tokens", 1)
    budget = f.thinking_token_budget(body)
    request = InferenceRequest(
        input=conversation,
        sampling=f.sampling(body),
        max_tokens=max_tokens,
        stop=stop,
        logprobs=logprob_options,
        stream=stream,
        thinking_token_budget=budget,
        output=output,
        cache_salt=f.cache_salt(body),
    )
    options = ResponsesOptions(
        model=model,
        stream=stream,
        logprobs=logprobs,
        top_logprobs=top,
        tools_echo=[_echo(t) for t in body.get("tools") or []],
        tool_choice_echo=body.get("tool_choice") or "auto",
        instructions=instructions,
        custom_tools={s.name: s.grammar for s in specs if s.kind == "custom"},
        namespaces=namespaces,
        parallel_tool_calls=parallel,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        max_output_tokens=max_tokens,
        reasoning_effort=effort,
        metadata=body.get("metadata") if isinstance(body.get("metadata"), dict) else None,
        text_format=fmt if output is not None and output.kind.startswith("json") else {"type": "text"},
    )
    return request, options
