"""The bounded grammar service: JSON schema, JSON object, Lark and regex through llguidance.

Compilation is bounded in size, wall time and parser fuel, and every new grammar is first
compiled in a worker process (grammar_probe.py) so a crash of the native compiler never
reaches the server; the cache is bounded by the bytes the worker measured. Failures name
the request field. Custom-tool validation matches complete texts with a byte-level matcher (one
token per byte); structured output compiles against the core's own tokenizer and hands
out pristine matchers that `frontend.constraint` copies per choice.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import llguidance
from tokenizers import Tokenizer

from helios.frontend.grammar_probe import ProbePool, ProbeRefused, TrialTokenizer, precheck

Syntax = Literal["lark", "regex"]
OUTPUT_KINDS = ("json_schema", "json_object", "lark", "regex")
MAX_GRAMMAR_BYTES = 64 * 1024
COMPILE_TIMEOUT_S = 2.0
CACHE_BYTES = 512 << 20  # compiled grammars kept per server, by measured size (clients repeat their schemas)
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


def parser_limits() -> llguidance.LLParserLimits:
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


def _bounded_build(
    build: Callable[[], llguidance.LLMatcher], field: str, what: str, timeout_s: float
) -> llguidance.LLMatcher:
    """Run `build` on a worker thread for at most timeout_s; any failure names `field`."""
    result: list[llguidance.LLMatcher | BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
            result.append(exc)

    # llguidance releases the GIL while compiling; an abandoned compile still stops at its fuel limits.
    worker = threading.Thread(target=run, name="grammar-compile", daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout_s)
    # The deadline holds also for a compile that finished while this thread waited for the GIL.
    if not result or time.monotonic() - started > timeout_s:
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


def compile_grammar(
    syntax: str, definition: str, field: str, max_bytes: int = MAX_GRAMMAR_BYTES, timeout_s: float = COMPILE_TIMEOUT_S
) -> CompiledGrammar:
    """Validate and compile a Lark or regex grammar for exact matching; failures name `field`."""
    if syntax not in ("lark", "regex"):
        raise GrammarError(f"{field}: grammar syntax must be 'lark' or 'regex', got {syntax!r}", field)
    _check_size(definition, field, max_bytes)
    try:
        precheck(syntax, definition)
    except ProbeRefused as exc:
        raise GrammarError(f"{field}: invalid {syntax} grammar: {exc}", field) from None
    source = grammar_source(syntax, definition)
    matcher = _bounded_build(
        lambda: llguidance.LLMatcher(_byte_tokenizer(), source, log_level=0, limits=parser_limits()),
        field,
        f"{syntax} grammar",
        timeout_s,
    )
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
    """Compiles output constraints against the core's tokenizer (and custom-tool grammars
    against bytes), each first tried in a worker process, with an LRU cache bounded in bytes.

    The llguidance tokenizer is built on first use (about a second for large vocabularies).
    Thread-safe: protocols compile on the frontend pool, the engine copies matchers.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        max_bytes: int = MAX_GRAMMAR_BYTES,
        timeout_s: float = COMPILE_TIMEOUT_S,
        probe: ProbePool | None = None,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.vocab_size = vocab_size  # the logits width; llguidance masks are sized to it
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self._source = tokenizer
        self._eos_ids = list(eos_ids)
        self.probe = probe or ProbePool(TrialTokenizer(tokenizer.to_str(), vocab_size, tuple(eos_ids)))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], tuple[object, int]] = OrderedDict()  # key -> (grammar, bytes)
        self._cached_bytes = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                plain = Tokenizer.from_str(self._source.to_str())  # a copy: padding and truncation must be off
                plain.no_padding()
                plain.no_truncation()
                self._tokenizer = llguidance.LLTokenizer(
                    plain.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_ids
                )
            return self._tokenizer

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def tool_grammar(self, syntax: str, definition: str, field: str) -> CompiledGrammar:
        """A custom tool's grammar for exact matching (`compile_grammar`), cached like output
        grammars: agents resend the same tools with every request."""
        if not isinstance(definition, str) or syntax not in ("lark", "regex"):
            return compile_grammar(syntax, definition, field)  # raises the field's GrammarError
        key = ("bytes", syntax, definition)
        cached = self._lookup(key)
        if cached is not None:
            return cached  # type: ignore[return-value]
        _check_size(definition, field, self.max_bytes)
        cost = self._trial("bytes", syntax, definition, field)
        grammar = compile_grammar(syntax, definition, field, self.max_bytes, self.timeout_s)
        self._store(key, grammar, cost)
        return grammar

    def compile(self, kind: str, definition: str, field: str) -> llguidance.LLMatcher:
        """A pristine matcher for the constraint (shared: callers deep_copy it before use)."""
        key = ("tokens", kind, definition)
        cached = self._lookup(key)
        if cached is not None:
            return cached  # type: ignore[return-value]
        if kind not in OUTPUT_KINDS:
            raise GrammarError(f"{field}: unknown output format {kind!r} ({', '.join(OUTPUT_KINDS)})", field)
        if kind != "json_object":
            _check_size(definition, field, self.max_bytes)
        what = {"json_schema": "JSON schema", "json_object": "JSON object format"}.get(kind, f"{kind} grammar")
        try:
            source = grammar_source(kind, definition)
        except Exception as exc:  # noqa: BLE001 - malformed schema text, regex or Lark
            raise GrammarError(f"{field}: invalid {what}: {_first_lines(str(exc))}", field) from None
        cost = self._trial("tokens", kind, definition, field, what)
        tokenizer = self.tokenizer

        def build() -> llguidance.LLMatcher:
            matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=parser_limits())
            if not matcher.is_error():
                matcher.compute_bitmask()  # builds the lexer now, inside the time bound
            return matcher

        matcher = _bounded_build(build, field, what, self.timeout_s)
        self._store(key, matcher, cost)
        return matcher

    def _trial(self, target: str, kind: str, definition: str, field: str, what: str = "grammar") -> int:
        try:
            return self.probe.trial(target, kind, definition, self.timeout_s)
        except ProbeRefused as exc:
            raise GrammarError(f"{field}: invalid {what}: {_first_lines(str(exc))}", field) from None

    def _lookup(self, key: tuple[str, str, str]) -> object | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                return None
            self._cache.move_to_end(key)
            return entry[0]

    def _store(self, key: tuple[str, str, str], value: object, cost: int) -> None:
        cost = max(cost, len(key[2]))  # never free: at least the text it was built from
        if cost > self.cache_bytes:
            return  # usable for this request, too large to keep
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = (value, cost)
            self._cached_bytes += cost
            while self._cached_bytes > self.cache_bytes:
                _, (_, freed) = self._cache.popitem(last=False)
                self._cached_bytes -= freed
