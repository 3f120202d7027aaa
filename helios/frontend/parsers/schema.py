"""Schema-guided conversion of tool arguments that a syntax writes as bare text.

Best effort, never strict: a value whose schema allows a string stays the raw string; other
declared types are parsed as JSON and kept as the raw string when that fails or the result
has the wrong type. Undeclared tools and parameters have no schema, so their values stay text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from helios.frontend.inference import ToolSpec

Schema = Mapping[str, Any]

_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


class ToolSchemas:
    """The declared tools' parameter schemas, by the name presented to the model."""

    def __init__(self, tools: Iterable[ToolSpec] = ()) -> None:
        self._tools = {tool.name: tool.parameters for tool in tools}

    def parameter(self, tool: str, key: str) -> Schema | None:
        root = self._tools.get(tool)
        if root is None:
            return None
        properties = resolve(root, root).get("properties")
        schema = properties.get(key) if isinstance(properties, Mapping) else None
        return resolve(schema, root) if isinstance(schema, Mapping) else None

    def root(self, tool: str) -> Schema | None:
        return self._tools.get(tool)


def resolve(schema: Schema, root: Schema) -> Schema:
    """Follow a local "$ref" ("#/$defs/X"); anything else is returned as it is."""
    for _ in range(8):
        ref = schema.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            return schema
        schema = node
    return schema


def types_of(schema: Schema | None) -> list[str]:
    """Declared JSON types, in order, including those of anyOf/oneOf branches."""
    if schema is None:
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            if isinstance(branch, Mapping):
                types += [t for t in types_of(branch) if t not in types]
    if not types and "properties" in schema:
        types = ["object"]
    if not types and "items" in schema:
        types = ["array"]
    return types


def convert(text: str, schema: Schema | None) -> object:
    """A bare-text value as its schema's type (see module docstring)."""
    types = types_of(schema)
    if not types or "string" in types:
        return text
    try:
        value = json.loads(text.strip())
    except ValueError:
        value = _python_literal(text.strip())
        if value is None and text.strip() != "None":
            return text
    if value is None:
        return None  # the model wrote null
    for name in types:
        expected = _PYTHON_TYPES.get(name)
        if expected is None:
            continue
        if isinstance(value, bool) and name in ("integer", "number"):
            continue  # JSON booleans are not numbers
        if isinstance(value, expected):
            return value
        if name == "integer" and isinstance(value, float) and value.is_integer():
            return int(value)
    return text


def _python_literal(text: str) -> object:
    """Python spellings models sometimes use for JSON scalars."""
    return {"True": True, "False": False, "None": None}.get(text)


def member(schema: Schema | None, root: Schema | None, key: str | None) -> Schema | None:
    """The schema of an object's member `key`, or of an array's items (key None)."""
    if schema is None or root is None:
        return None
    if key is not None:
        properties = schema.get("properties")
        child = properties.get(key) if isinstance(properties, Mapping) else None
    else:
        child = schema.get("items")
    return resolve(child, root) if isinstance(child, Mapping) else None
