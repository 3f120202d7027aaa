"""The bounded grammar service: JSON schema, JSON object, Lark and regex through llguidance.

Compilation is bounded in size, wall time and parser fuel; failures name the request
field. Custom-tool validation matches complete texts with a byte-level matcher (one
token per byte); structured output compiles against the core's own tokenizer and hands
out pristine matchers that `frontend.constraint` copies per choice.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import llguidance
from tokenizers import Tokenizer

Syntax = Literal["lark", "regex"]
OUTPUT_KINDS = ("json_schema", "json_object", "lark", "regex")
MAX_GRAMMAR_BYTES = 64 * 1024
COMPILE_TIMEOUT_S = 2.0
CACHE_SIZE = 64  # compiled output grammars kept per server (clients repeat their schemas)
# Whitespace between JSON tokens: at most one newline and bounded indentation, so a small
# model cannot spend its whole output budget on spaces inside an unfinished document.
JSON_WHITESPACE = r"[\x20\x09]{1,8}|\x0A[\x20\x09]{0,32}"
_EOS = 256  # the byte tokenizer's only non-byte token


class GrammarError(ValueError):
    """An invalid or over-budget grammar (HTTP 400); `field` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class _ByteTokens:
    """A tokenizer whose tokens are the 256 bytes, for llguidance's TokenizerWrapper."""

    eos_token_id = _EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<|eos|>"]
    special_token_ids = [_EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()), slices=[])


def _limits() -> llguidance.LLParserLimits:
    # Default fuel bounds each step; non-verbose errors keep parser state out of messages.
    return llguidance.LLParserLimits(verbose_errors=False)


def _first_lines(message: str, limit: int = 300) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:limit]


def _check_size(definition: object, field: str, max_bytes: int) -> None:
    if not isinstance(definition, str) or not definition.strip():
        raise GrammarError(f"{field}: the grammar definition must be a nonempty string", field)
    size = len(definition.encode("utf-8"))
    if size > max_bytes:
        raise GrammarError(f"{field}: the grammar is {size} bytes, over the {max_bytes}-byte limit", field)


def _bounded_build(build: Callable[[], llguidance.LLMatcher], field: str, what: str,
                   timeout_s: float) -> llguidance.LLMatcher:  # fmt: skip
    """Run `build` on a worker thread for at most timeout_s; any failure names `field`."""
    result: list[llguidance.LLMatcher | BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
            result.append(exc)

    # llguidance releases the GIL while compiling; an abandoned compile still stops at its fuel limits.
    worker = threading.Thread(target=run, name="grammar-compile", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not result:
        raise GrammarError(f"{field}: compiling the grammar took longer than {timeout_s:g} s", field)
    outcome = result[0]
    if isinstance(outcome, BaseException):
        raise GrammarError(f"{field}: invalid {what}: {_first_lines(str(outcome))}", field)
    if outcome.is_error():
        raise GrammarError(f"{field}: invalid {what}: {_first_lines(outcome.get_error())}", field)
    return outcome


# ---------------------------------------------------------------------------- custom-tool validation
@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    syntax: Syntax
    definition: str  # the grammar text as the client sent it
    _matcher: llguidance.LLMatcher  # pristine (nothing consumed); copied for each match

    def matches(self, text: str) -> bool:
        """Whether the complete text (its exact UTF-8 bytes) is a sentence of the grammar.

        Fails closed: text whose parse exceeds llguidance's per-step limits does not match.
        """
        matcher = self._matcher.deep_copy()  # a matcher never leaves an error state; start fresh
        return matcher.consume_tokens(list(text.encode("utf-8"))) and matcher.is_accepting() and not matcher.is_error()


def compile_grammar(syntax: str, definition: str, field: str, max_bytes: int = MAX_GRAMMAR_BYTES,
                    timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:  # fmt: skip
    """Validate and compile a Lark or regex grammar for exact matching; failures name `field`."""
    if syntax not in ("lark", "regex"):
        raise GrammarError(f"{field}: grammar syntax must be 'lark' or 'regex', got {syntax!r}", field)
    _check_size(definition, field, max_bytes)
    source = grammar_source(syntax, definition)
    matcher = _bounded_build(lambda: llguidance.LLMatcher(_byte_tokenizer(), source, log_level=0, limits=_limits()),
                             field, f"{syntax} grammar", timeout_s)  # fmt: skip
    return CompiledGrammar(syntax, definition, matcher)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- structured output
def grammar_source(kind: str, definition: str) -> str:
    """The llguidance grammar of an output constraint (json_schema: the schema as JSON text)."""
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(definition)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(definition)
    schema = json.loads(definition) if kind == "json_schema" else {"type": "object"}
    # Defaults first: a schema's own "x-guidance" options override them.
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})


class GrammarService:
    """Compiles output constraints against the core's tokenizer, with a small LRU cache.

    The llguidance tokenizer is built on first use (about a second for large vocabularies).
    Thread-safe: protocols compile on the frontend pool, the engine copies matchers.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                 max_bytes: int = MAX_GRAMMAR_BYTES, timeout_s: float = COMPILE_TIMEOUT_S) -> None:  # fmt: skip
        self.vocab_size = vocab_size  # the logits width; llguidance masks are sized to it
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._source = tokenizer
        self._eos_ids = list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._tool_cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                plain = Tokenizer.from_str(self._source.to_str())  # a copy: padding and truncation must be off
                plain.no_padding()
                plain.no_truncation()
                self._tokenizer = llguidance.LLTokenizer(plain.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos_ids)  # fmt: skip
            return self._tokenizer

    def tool_grammar(self, syntax: str, definition: str, field: str) -> CompiledGrammar:
        """A custom tool's grammar for exact matching (`compile_grammar`), cached like output
        grammars: agents resend the same tools with every request."""
        if not isinstance(definition, str):
            return compile_grammar(syntax, definition, field)  # raises the field's GrammarError
        key = (syntax, definition)
        with self._lock:
            if key in self._tool_cache:
                self._tool_cache.move_to_end(key)
                return self._tool_cache[key]
        grammar = compile_grammar(syntax, definition, field, self.max_bytes, self.timeout_s)
        with self._lock:
            self._tool_cache[key] = grammar
            while len(self._tool_cache) > CACHE_SIZE:
                self._tool_cache.popitem(last=False)
        return grammar

    def compile(self, kind: str, definition: str, field: str) -> llguidance.LLMatcher:
        """A pristine matcher for the constraint (shared: callers deep_copy it before use)."""
        key = (kind, definition)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if kind not in OUTPUT_KINDS:
            raise GrammarError(f"{field}: unknown output format {kind!r} ({', '.join(OUTPUT_KINDS)})", field)
        if kind != "json_object":
            _check_size(definition, field, self.max_bytes)
        tokenizer = self.tokenizer
        what = {"json_schema": "JSON schema", "json_object": "JSON object format"}.get(kind, f"{kind} grammar")

        def build() -> llguidance.LLMatcher:
            matcher = llguidance.LLMatcher(tokenizer, grammar_source(kind, definition), log_level=0, limits=_limits())
            if not matcher.is_error():
                matcher.compute_bitmask()  # builds the lexer now, inside the time bound
            return matcher

        matcher = _bounded_build(build, field, what, self.timeout_s)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher
