"""vLLM's text-only Decisions protocol (POST /v1/decisions) over the shared label scorer.

Every object forbids unknown fields; any schema failure is an OpenAI-style 400 naming the
offending field as a dotted path. Choice/score confidence is the winning label's
full-vocabulary probability (normalized probability × raw label mass).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from helios.frontend.inference import RequestError
from helios.frontend.scoring import (
    MAX_LEVELS,
    MAX_OPTIONS,
    MAX_QUESTIONS,
    LabelRead,
    Option,
    QuestionSpec,
    ScoringUsage,
    binary_question,
    expected_score,
    first_argmax,
    label_mass_confidence,
)

MAX_SAFETY_IDENTIFIER = 128
_TOP = {"model", "input", "questions", "safety_identifier"}
_QUESTION = {
    "predicate": {"type", "name", "instructions"},
    "choice": {"type", "name", "instructions", "choices"},
    "score": {"type", "name", "instructions", "levels"},
}


@dataclass(frozen=True, slots=True)
class DecisionQuestion:
    kind: str  # "predicate" | "choice" | "score"
    name: str | None  # echoed back; duplicates allowed
    spec: QuestionSpec
    values: tuple[str | bool, ...] = ()  # choice: the typed values, in order
    labels: tuple[str, ...] = ()  # score: level labels, lowest first


@dataclass(frozen=True, slots=True)
class DecisionsRequest:
    model: str
    text: str  # the flattened input
    questions: tuple[DecisionQuestion, ...]


def _fail(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param)


def _fields(value: Any, param: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(param, f"must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _fail(f"{param}.{unknown[0]}" if param else unknown[0], "unknown field (extra fields are not permitted)")
    return value


def _string(body: dict[str, Any], key: str, param: str, *, required: bool) -> str | None:
    if key not in body:
        if required:
            raise _fail(param, "field required")
        return None
    value = body[key]
    if not isinstance(value, str):
        raise _fail(param, f"must be a string, got {'null' if value is None else type(value).__name__}")
    return value


def _array(body: dict[str, Any], key: str, param: str, low: int, high: int) -> list[Any]:
    if key not in body:
        raise _fail(param, "field required")
    value = body[key]
    if not isinstance(value, list):
        raise _fail(param, f"must be an array, got {type(value).__name__}")
    if not low <= len(value) <= high:
        raise _fail(param, f"must have {low} to {high} items, got {len(value)}")
    return value


def _input_text(value: Any) -> str:
    """A string, or user messages of text / input_text parts (parts join with newlines,
    messages with blank lines)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail("input", "must be a string or an array of user messages")
    messages = []
    for i, item in enumerate(value):
        param = f"input.{i}"
        message = _fields(item, param, {"role", "content", "type"})
        if message.get("type", "message") != "message":
            raise _fail(f"{param}.type", "must be 'message'")
        if message.get("role") != "user":
            raise _fail(f"{param}.role", f"only 'user' messages are supported, got {message.get('role')!r}")
        content = message.get("content")
        if isinstance(content, str):
            messages.append(content)
            continue
        if not isinstance(content, list):
            raise _fail(f"{param}.content", "must be a string or an array of text / input_text parts")
        texts = []
        for j, part in enumerate(content):
            where = f"{param}.content.{j}"
            if isinstance(part, dict) and part.get("type") in ("input_image", "input_file", "image_url"):
                raise _fail(where, "Decisions supports text input only (images and assets are not accepted)")
            fields = _fields(part, where, {"type", "text"})
            if fields.get("type") not in ("text", "input_text"):
                raise _fail(f"{where}.type", f"must be 'text' or 'input_text', got {fields.get('type')!r}")
            texts.append(_string(fields, "text", f"{where}.text", required=True))
        messages.append("\n".join(texts))
    return "\n\n".join(messages)


def _description(item: dict[str, Any], param: str) -> str | None:
    return _string(item, "description", f"{param}.description", required=False) or None


def _choice_spec(
    question: dict[str, Any], param: str, instructions: str
) -> tuple[QuestionSpec, tuple[str | bool, ...]]:
    choices = _array(question, "choices", f"{param}.choices", 2, MAX_OPTIONS)
    options, values, seen = [], [], set()
    for i, item in enumerate(choices):
        where = f"{param}.choices.{i}"
        fields = _fields(item, where, {"value", "description"})
        if "value" not in fields:
            raise _fail(f"{where}.value", "field required")
        value = fields["value"]
        if not isinstance(value, (str, bool)):
            raise _fail(f"{where}.value", f"must be a string or a boolean, got {type(value).__name__}")
        if (type(value), value) in seen:
            raise _fail(f"{where}.value", f"duplicate choice value {value!r}")
        seen.add((type(value), value))
        values.append(value)
        options.append(Option(json.dumps(value, ensure_ascii=False), _description(fields, where)))
    return QuestionSpec("choice", instructions, tuple(options)), tuple(values)


def _score_spec(question: dict[str, Any], param: str, instructions: str) -> tuple[QuestionSpec, tuple[str, ...]]:
    levels = _array(question, "levels", f"{param}.levels", 2, MAX_LEVELS)
    options, labels = [], []
    for i, item in enumerate(levels):
        where = f"{param}.levels.{i}"
        fields = _fields(item, where, {"label", "description"})
        label = _string(fields, "label", f"{where}.label", required=True)
        labels.append(label)
        options.append(Option(label, _description(fields, where)))
    return QuestionSpec("score", instructions, tuple(options)), tuple(labels)


def _question(item: Any, index: int) -> DecisionQuestion:
    param = f"questions.{index}"
    if not isinstance(item, dict):
        raise _fail(param, f"must be an object, got {type(item).__name__}")
    kind = item.get("type")
    if kind not in _QUESTION:
        raise _fail(f"{param}.type", f"unsupported question type {kind!r} (expected predicate, choice or score)")
    question = _fields(item, param, _QUESTION[kind])
    instructions = _string(question, "instructions", f"{param}.instructions", required=True)
    if "name" in question and not isinstance(question["name"], str):
        raise _fail(f"{param}.name", "name must be a string when provided")
    name = question.get("name")
    if kind == "predicate":
        return DecisionQuestion(kind, name, binary_question(instructions))
    if kind == "choice":
        spec, values = _choice_spec(question, param, instructions)  # type: ignore[arg-type]
        return DecisionQuestion(kind, name, spec, values=values)
    spec, labels = _score_spec(question, param, instructions)  # type: ignore[arg-type]
    return DecisionQuestion(kind, name, spec, labels=labels)


def decode(body: dict[str, Any]) -> DecisionsRequest:
    if "assets" in body:
        raise _fail("assets", "Decisions supports text input only (images and assets are not accepted)")
    _fields(body, "", _TOP)
    model = _string(body, "model", "model", required=True)
    if "input" not in body:
        raise _fail("input", "field required")
    text = _input_text(body["input"])
    safety = body.get("safety_identifier")
    if safety is not None and (not isinstance(safety, str) or len(safety) > MAX_SAFETY_IDENTIFIER):
        raise _fail("safety_identifier", f"must be a string of at most {MAX_SAFETY_IDENTIFIER} characters or null")
    questions = _array(body, "questions", "questions", 1, MAX_QUESTIONS)
    decoded = tuple(_question(q, i) for i, q in enumerate(questions))
    return DecisionsRequest(model, text, decoded)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- answers
def answer(question: DecisionQuestion, read: LabelRead) -> dict[str, Any]:
    p = read.probabilities
    if question.kind == "predicate":
        return {"type": "predicate", "name": question.name, "probability": p[0]}
    if question.kind == "choice":
        return {
            "type": "choice",
            "name": question.name,
            "choice": question.values[first_argmax(p)],
            "probabilities": [{"value": v, "probability": x} for v, x in zip(question.values, p)],
            "confidence": label_mass_confidence(read),
        }
    return {
        "type": "score",
        "name": question.name,
        "score": expected_score(p),
        "probabilities": [
            {"value": i, "label": label, "probability": x} for i, (label, x) in enumerate(zip(question.labels, p))
        ],
        "confidence": label_mass_confidence(read),
    }


def response(model: str, request: DecisionsRequest, reads: list[LabelRead], usage: ScoringUsage) -> dict[str, Any]:
    return {
        "model": model,
        "answers": [answer(q, read) for q, read in zip(request.questions, reads, strict=True)],
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.input_tokens + usage.output_tokens,
        },
    }
