"""TypeSafe System One (POST /v1/systemone): wire JSON <-> scoring questions, Jev answers.

Schema failures are FastAPI/pydantic-style 422 bodies: {"detail": [{type, loc, msg,
input, ctx?}]} with loc starting at "body" (spec/decisions-notes.md §3). Unknown fields
are ignored, as the live service does; confidence uses the Jev formulas.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from helios.frontend.inference import ImagePart, RequestError
from helios.frontend.scoring import (
    MAX_LEVELS,
    MAX_OPTIONS,
    MAX_QUESTIONS,
    Content,
    LabelRead,
    Option,
    QuestionSpec,
    ScoringUsage,
    binary_question,
    choice_confidence,
    expected_score,
    first_argmax,
    joined,
    score_confidence,
)

TAGS = ("noul", "choice", "score")
ASSETS_HEADER = "typesafe-danger-zone-images"


# format -> (media type, the file's first bytes): System One assets are PNG or JPEG
ASSET_FORMATS = {"png": ("image/png", b"\x89PNG\r\n\x1a\n"), "jpeg": ("image/jpeg", b"\xff\xd8\xff")}


class SchemaError(Exception):
    """422: the body does not match the System One schema; `entries` are the detail list."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(e["msg"] for e in entries))
        self.entries = entries

    def body(self) -> dict[str, Any]:
        return {"detail": self.entries}


@dataclass(frozen=True, slots=True)
class SystemOneQuestion:
    key: str  # caller-chosen id; answers come back under it
    tag: str  # "noul" | "choice" | "score"
    spec: QuestionSpec
    names: tuple[str, ...] = ()  # choice: criteria keys in order
    legend: tuple[Any, ...] = ()  # score: the original levels, lowest first


@dataclass(frozen=True, slots=True)
class SystemOneRequest:
    model: str
    state: Content  # rendered: text verbatim, structured JSON serialized; asset references as images
    questions: tuple[SystemOneQuestion, ...]


@dataclass
class _Errors:
    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, type: str, loc: list[Any], msg: str, value: Any, ctx: dict[str, Any] | None = None) -> None:
        entry: dict[str, Any] = {"type": type, "loc": ["body", *loc], "msg": msg, "input": value}
        if ctx is not None:
            entry["ctx"] = ctx
        self.entries.append(entry)

    def missing(self, loc: list[Any], value: Any) -> None:
        self.add("missing", loc, "Field required", value)

    def is_object(self, loc: list[Any], value: Any) -> bool:
        """A model's fields come in an object; anything else is reported as pydantic does."""
        if isinstance(value, dict):
            return True
        msg = "Input should be a valid dictionary or object to extract fields from"
        self.add("model_attributes_type", loc, msg, value)
        return False

    def structured(self, loc: list[Any], value: Any) -> bool:
        """string | object | array, reported per union branch as pydantic does."""
        if isinstance(value, (str, dict, list)):
            return True
        self.add("string_type", [*loc, "str"], "Input should be a valid string", value)
        self.add("dict_type", [*loc, "dict[any,any]"], "Input should be a valid dictionary", value)
        self.add("list_type", [*loc, "list[any]"], "Input should be a valid list", value)
        return False

    def length(self, loc: list[Any], value: Any, kind: str, low: int, high: int) -> bool:
        size = len(value)
        if low <= size <= high:
            return True
        short = size < low
        bound = low if short else high
        message = (
            f"{kind} should have at {'least' if short else 'most'} {bound} item{'s' if bound != 1 else ''} "
            f"after validation, not {size}"
        )
        ctx = {"field_type": kind, ("min_length" if short else "max_length"): bound, "actual_length": size}
        self.add("too_short" if short else "too_long", loc, message, value, ctx)
        return False


def as_text(value: Any) -> str:
    """What the model reads for a string/object/array value: text verbatim, JSON otherwise."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _noul(key: str, question: dict[str, Any], errors: _Errors, refs: References) -> SystemOneQuestion | None:
    loc = ["questions", key, "noul"]
    instructions = question.get("instructions")
    criteria = question.get("criteria")
    ok = instructions is None or errors.structured([*loc, "instructions"], instructions)
    sides: dict[str, Content | None] = {"true": None, "false": None}
    if criteria is not None:
        if not isinstance(criteria, dict):
            errors.add("dict_type", [*loc, "criteria"], "Input should be a valid dictionary", criteria)
            return None
        for side in sides:
            value = criteria.get(side)
            if value is None:
                continue
            if errors.structured([*loc, "criteria", side], value):
                sides[side] = refs.content(value)
            else:
                ok = False
    if instructions is None and not any(sides.values()):
        errors.add("missing", [*loc, "instructions"], "Noul question must have criteria or instructions", question)
        return None
    if not ok:
        return None
    spec = binary_question(None if instructions is None else refs.content(instructions), sides["true"], sides["false"])
    return SystemOneQuestion(key, "noul", spec)


def _instructions(
    loc: list[Any], question: dict[str, Any], errors: _Errors, refs: References
) -> tuple[bool, Content | None]:
    """(valid, rendered text); instructions are optional for choice and score questions."""
    value = question.get("instructions")
    if value is None:
        return True, None
    if not errors.structured([*loc, "instructions"], value):
        return False, None
    return True, refs.content(value)


# A question's criteria container: (error type, message, the name its length errors use).
_CONTAINERS: dict[type, tuple[str, str, str]] = {
    dict: ("dict_type", "Input should be a valid dictionary", "Dictionary"),
    list: ("list_type", "Input should be a valid list", "List"),
}


def _criteria(
    loc: list[Any], question: dict[str, Any], errors: _Errors, refs: References, container: type, most: int
) -> tuple[bool, Content | None, Any]:
    """(valid so far, rendered instructions, criteria) of a choice or score question, whose
    criteria are a required `container` of 1 to `most` items; criteria None: none to decode
    (the error is recorded)."""
    ok, instructions = _instructions(loc, question, errors, refs)
    if "criteria" not in question:
        errors.missing([*loc, "criteria"], question)
        return ok, instructions, None
    criteria = question["criteria"]
    kind, message, name = _CONTAINERS[container]
    if not isinstance(criteria, container):
        errors.add(kind, [*loc, "criteria"], message, criteria)
        return ok, instructions, None
    ok = errors.length([*loc, "criteria"], criteria, name, 1, most) and ok
    return ok, instructions, criteria


def _choice(key: str, question: dict[str, Any], errors: _Errors, refs: References) -> SystemOneQuestion | None:
    loc = ["questions", key, "choice"]
    ok, instructions, criteria = _criteria(loc, question, errors, refs, dict, MAX_OPTIONS)
    if criteria is None:
        return None
    options = []
    for name, description in criteria.items():
        if description is not None and not errors.structured([*loc, "criteria", name], description):
            ok = False
            continue
        options.append(Option(name, None if description is None else refs.content(description)))
    if not ok:
        return None
    return SystemOneQuestion(key, "choice", QuestionSpec("choice", instructions, tuple(options)), tuple(criteria))


def _score(key: str, question: dict[str, Any], errors: _Errors, refs: References) -> SystemOneQuestion | None:
    loc = ["questions", key, "score"]
    ok, instructions, levels = _criteria(loc, question, errors, refs, list, MAX_LEVELS)
    if levels is None:
        return None
    for index, level in enumerate(levels):
        ok = errors.structured([*loc, "criteria", index], level) and ok
    if not ok:
        return None
    spec = QuestionSpec("score", instructions, tuple(Option(refs.content(level)) for level in levels))
    return SystemOneQuestion(key, "score", spec, legend=tuple(levels))


_DECODERS = {"noul": _noul, "choice": _choice, "score": _score}


def _question(key: str, question: Any, errors: _Errors, refs: References) -> SystemOneQuestion | None:
    loc = ["questions", key]
    if not errors.is_object(loc, question):
        return None
    tag = question.get("type")
    if tag is None:
        errors.add(
            "union_tag_not_found",
            loc,
            "Unable to extract tag using discriminator 'type'",
            question,
            {"discriminator": "'type'"},
        )
        return None
    if tag not in TAGS:
        expected = ", ".join(f"'{t}'" for t in TAGS)
        errors.add(
            "union_tag_invalid",
            loc,
            f"Input tag {tag!r} found using 'type' does not match any of the expected tags: {expected}",
            question,
            {"discriminator": "'type'", "tag": str(tag), "expected_tags": expected},
        )
        return None
    return _DECODERS[tag](key, question, errors, refs)


class References:
    """Asset references in string values -> images (spec: System One image assets).

    A string equal to an asset name is that image; otherwise names are replaced at their
    nonoverlapping left-to-right occurrences (the longest name wins at one position). Inside
    structured JSON only string values change (keys stay text): a whole-value reference
    stands where the quoted string was, a partial one inside its quotes. `used` collects the
    names met, so unreferenced assets can be refused.
    """

    def __init__(self, assets: dict[str, ImagePart]) -> None:
        self.assets = assets
        self.used: set[str] = set()
        names = sorted(assets, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self._nonce = secrets.token_hex(8)  # slots in serialized JSON no client string can imitate

    def content(self, value: Any) -> Content:
        if self._pattern is None:
            return as_text(value)
        if isinstance(value, str):
            return self._string(value)
        found: list[Content] = []

        def walk(node: Any) -> Any:
            if isinstance(node, str):
                replaced = self._string(node)
                if isinstance(replaced, str):
                    return replaced
                found.append(replaced)
                return f"\ue000{self._nonce}:{len(found) - 1}\ue001"
            if isinstance(node, dict):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            return node

        text = json.dumps(walk(value), ensure_ascii=False)
        if not found:
            return text
        pieces: list[Content] = []
        slots = re.compile(f'"\ue000{self._nonce}:(\\d+)\ue001"')
        last = 0
        for match in slots.finditer(text):
            pieces.append(text[last : match.start()])
            replaced = found[int(match.group(1))]
            whole = len(replaced) == 1 and isinstance(replaced[0], ImagePart)
            inner = [json.dumps(p, ensure_ascii=False)[1:-1] if isinstance(p, str) else p for p in replaced]
            pieces.append(joined(*inner) if whole else joined('"', *inner, '"'))
            last = match.end()
        pieces.append(text[last:])
        return joined(*pieces)

    def _string(self, value: str) -> Content:
        if value in self.assets:  # whole-value match first
            self.used.add(value)
            return (self.assets[value],)
        assert self._pattern is not None
        pieces: list[Content] = []
        last = 0
        for match in self._pattern.finditer(value):
            self.used.add(match.group())
            pieces += [value[last : match.start()], (self.assets[match.group()],)]
            last = match.end()
        if not pieces:
            return value
        pieces.append(value[last:])
        return joined(*pieces)


def decode_assets(body: dict[str, Any], parts: dict[str, bytes] | None = None) -> dict[str, ImagePart]:
    """The request's image assets by name: an asset's multipart part (when it names one) wins over
    its data_base64; every part must belong to exactly one asset. Shape errors are 422 entries;
    undecodable or mismatched data, and part bookkeeping, are 400s."""
    raw = body.get("assets")
    parts = parts or {}
    if raw is None or raw == {}:
        if parts:
            raise RequestError(f"multipart part {next(iter(parts))!r} belongs to no asset", "assets")
        return {}
    errors = _Errors()
    if not isinstance(raw, dict):
        errors.add("dict_type", ["assets"], "Input should be a valid dictionary", raw)
        raise SchemaError(errors.entries)
    for name, asset in raw.items():
        loc = ["assets", name]
        if not errors.is_object(loc, asset):
            continue
        if asset.get("type", "image") != "image":
            raise RequestError(
                f"asset {name!r} has type {asset.get('type')!r}: only image assets are supported "
                "(audio and video are not)",
                "assets",
            )
        if "format" not in asset:
            errors.missing([*loc, "format"], asset)
        elif asset["format"] not in ASSET_FORMATS:
            errors.add(
                "literal_error",
                [*loc, "format"],
                "Input should be 'png' or 'jpeg'",
                asset["format"],
                {"expected": "'png' or 'jpeg'"},
            )
        for key in ("data_base64", "part"):
            if asset.get(key) is not None and not isinstance(asset[key], str):
                errors.add("string_type", [*loc, key], "Input should be a valid string", asset[key])
        if asset.get("data_base64") is None and asset.get("part") is None:
            errors.missing([*loc, "data_base64"], asset)
    if errors.entries:
        raise SchemaError(errors.entries)
    owners: dict[str, str] = {}
    out: dict[str, ImagePart] = {}
    for name, asset in raw.items():
        media_type, magic = ASSET_FORMATS[asset["format"]]
        part = asset.get("part")
        if part is not None:
            if part not in parts:
                raise RequestError(
                    f"asset {name!r} names multipart part {part!r}, which the request does not have", "assets"
                )
            if part in owners:
                raise RequestError(
                    f"multipart part {part!r} belongs to both asset {owners[part]!r} and {name!r}", "assets"
                )
            owners[part] = name
            data = parts[part]
        else:
            try:
                data = base64.b64decode(asset["data_base64"], validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(f"asset {name!r}: data_base64 is not valid base64", "assets") from None
        if not data.startswith(magic):
            raise RequestError(
                f"asset {name!r} is not a {asset['format'].upper()} image (its format field says {asset['format']!r})",
                "assets",
            )
        out[name] = ImagePart(data, media_type)
    orphan = next((p for p in parts if p not in owners), None)
    if orphan is not None:
        raise RequestError(f"multipart part {orphan!r} belongs to no asset", "assets")
    return out


def decode(body: dict[str, Any], assets: dict[str, ImagePart] | None = None) -> SystemOneRequest:
    """The request, or SchemaError with every problem found; asset references become images and
    an asset no string references is refused (400)."""
    errors = _Errors()
    refs = References(assets or {})
    model = body.get("model")
    if "model" not in body:
        errors.missing(["model"], body)
    elif not isinstance(model, str):
        errors.add("string_type", ["model"], "Input should be a valid string", model)
    if "state" not in body:
        errors.missing(["state"], body)
    else:
        errors.structured(["state"], body["state"])
    decoded: list[SystemOneQuestion] = []
    questions = body.get("questions")
    if "questions" not in body:
        errors.missing(["questions"], body)
    elif not isinstance(questions, dict):
        errors.add("dict_type", ["questions"], "Input should be a valid dictionary", questions)
    elif errors.length(["questions"], questions, "Dictionary", 1, MAX_QUESTIONS):
        decoded = [q for key, value in questions.items() if (q := _question(key, value, errors, refs)) is not None]
    if errors.entries:
        raise SchemaError(errors.entries)
    state = refs.content(body["state"])
    unused = [name for name in refs.assets if name not in refs.used]
    if unused:
        raise RequestError(
            f"asset{'s' if len(unused) > 1 else ''} {', '.join(map(repr, unused))} "
            f"{'are' if len(unused) > 1 else 'is'} never referenced in state, instructions or criteria",
            "assets",
        )
    return SystemOneRequest(model, state, tuple(decoded))


def uses_assets(body: dict[str, Any]) -> bool:
    """Whether the request carries image assets (accepted only with a vision core)."""
    return body.get("assets") not in (None, {}, [])


# ---------------------------------------------------------------------------- answers
def answer(question: SystemOneQuestion, read: LabelRead) -> dict[str, Any]:
    p = read.probabilities
    if question.tag == "noul":
        return {"type": "noul", "noul": p[0]}
    if question.tag == "choice":
        return {
            "type": "choice",
            "choice": question.names[first_argmax(p)],
            "probabilities": dict(zip(question.names, p)),
            "confidence": choice_confidence(p),
        }
    legend = {str(i): level for i, level in enumerate(question.legend)}  # original levels, unchanged
    return {
        "type": "score",
        "score": expected_score(p),
        "legend": legend,
        "probabilities": {str(i): x for i, x in enumerate(p)},
        "confidence": score_confidence(p),
    }


def response(model: str, request: SystemOneRequest, reads: list[LabelRead], usage: ScoringUsage) -> dict[str, Any]:
    answers = {q.key: answer(q, read) for q, read in zip(request.questions, reads, strict=True)}
    return {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
    }
