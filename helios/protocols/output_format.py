"""Structured-output fields of every protocol, decoded into one OutputConstraint.

Chat's response_format, Responses' text.format and Messages' output_format /
output_config.format share the JSON-schema and JSON-object shapes; the native grammar
extension ({"type": "grammar", "syntax": "lark" | "regex", "definition": text}) is the
same everywhere. Compiling (and its errors) happens below, in the frontend.
"""

from __future__ import annotations

import json
from typing import Any

from helios.frontend.inference import OutputConstraint, RequestError

SYNTAXES = ("lark", "regex")


def _schema(value: Any, param: str) -> OutputConstraint:
    if value is None:
        value = {}  # OpenAI's schema is optional: any JSON value
    if not isinstance(value, (dict, bool)):
        raise RequestError(f"{param} must be a JSON schema object", param)
    return OutputConstraint("json_schema", json.dumps(value, ensure_ascii=False), param)


def _grammar(value: dict[str, Any], param: str) -> OutputConstraint:
    syntax = value.get("syntax")
    definition = value.get("definition", value.get("grammar"))
    if syntax not in SYNTAXES:
        raise RequestError(f"{param}.syntax must be 'lark' or 'regex' (got {syntax!r})", f"{param}.syntax")
    if not isinstance(definition, str) or not definition:
        raise RequestError(f"{param}.definition must be a nonempty grammar string", f"{param}.definition")
    return OutputConstraint(syntax, definition, f"{param}.definition")


def _kind(value: Any, param: str, kinds: tuple[str, ...]) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in kinds:
        raise RequestError(f"{param}.type must be one of {', '.join(kinds)} (got {kind!r})", f"{param}.type")
    return kind


def chat_response_format(value: Any) -> OutputConstraint | None:
    """Chat Completions response_format: text, json_object, json_schema {name, schema, strict}, or grammar."""
    return _openai_format(value, "response_format", nested=True)


def responses_text_format(value: Any) -> OutputConstraint | None:
    """Responses text.format: text, json_object, json_schema {name, schema, strict}, or grammar."""
    return _openai_format(value, "text.format", nested=False)


def _openai_format(value: Any, param: str, nested: bool) -> OutputConstraint | None:
    """OpenAI's output format at `param`; its json_schema's {name, schema, strict} under
    `json_schema` (Chat: nested) or beside its type (Responses)."""
    if value is None:
        return None
    kind = _kind(value, param, ("text", "json_object", "json_schema", "grammar"))
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_object", "", param)
    if kind == "grammar":
        return _grammar(value, param)
    spec, where = (value.get("json_schema"), f"{param}.json_schema") if nested else (value, param)
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        if nested:
            raise RequestError(f"{where} needs a nonempty name", where)
        raise RequestError(f"{param} json_schema needs a nonempty name", f"{param}.name")
    return _schema(spec.get("schema"), f"{where}.schema")


def messages_output_format(body: dict[str, Any], config: dict[str, Any]) -> OutputConstraint | None:
    """Messages output_config.format (or the earlier top-level output_format): json_schema or grammar."""
    fields = [
        (name, value)
        for name, value in (
            ("output_config.format", config.get("format")),
            ("output_format", body.get("output_format")),
        )
        if value is not None
    ]
    if not fields:
        return None
    if len(fields) > 1 and fields[0][1] != fields[1][1]:
        raise RequestError("output_format and output_config.format must match when both are given", "output_format")
    param, value = fields[0]
    if _kind(value, param, ("json_schema", "grammar")) == "grammar":
        return _grammar(value, param)
    return _schema(value.get("schema"), f"{param}.schema")
