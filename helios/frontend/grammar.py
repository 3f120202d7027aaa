"""The bounded grammar service: Lark and regex grammars compiled by llguidance.

Compilation is bounded in size, wall time and parser fuel; failures name the request
field. A compiled grammar answers whether a complete text belongs to its language, using
a byte-level matcher (one token per byte), so no model tokenizer is involved.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Literal

import llguidance

Syntax = Literal["lark", "regex"]
MAX_GRAMMAR_BYTES = 64 * 1024
COMPILE_TIMEOUT_S = 2.0
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


def _first_lines(message: str, limit: int = 300) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:limit]


def compile_grammar(syntax: str, definition: str, field: str, max_bytes: int = MAX_GRAMMAR_BYTES,
                    timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:  # fmt: skip
    """Validate and compile a grammar; any failure is a GrammarError naming `field`."""
    if syntax not in ("lark", "regex"):
        raise GrammarError(f"{field}: grammar syntax must be 'lark' or 'regex', got {syntax!r}", field)
    if not isinstance(definition, str) or not definition.strip():
        raise GrammarError(f"{field}: the grammar definition must be a nonempty string", field)
    size = len(definition.encode("utf-8"))
    if size > max_bytes:
        raise GrammarError(f"{field}: the grammar is {size} bytes, over the {max_bytes}-byte limit", field)
    result: list[llguidance.LLMatcher | BaseException] = []

    def build() -> None:
        try:
            source = (llguidance.LLMatcher.grammar_from_lark(definition) if syntax == "lark"
                      else llguidance.LLMatcher.grammar_from_regex(definition))  # fmt: skip
            result.append(llguidance.LLMatcher(_byte_tokenizer(), source, log_level=0, limits=_limits()))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
            result.append(exc)

    # llguidance releases the GIL while compiling; an abandoned compile still stops at its fuel limits.
    worker = threading.Thread(target=build, name="grammar-compile", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not result:
        raise GrammarError(f"{field}: compiling the grammar took longer than {timeout_s:g} s", field)
    outcome = result[0]
    if isinstance(outcome, BaseException):
        raise GrammarError(f"{field}: invalid {syntax} grammar: {_first_lines(str(outcome))}", field)
    if outcome.is_error():
        raise GrammarError(f"{field}: invalid {syntax} grammar: {_first_lines(outcome.get_error())}", field)
    return CompiledGrammar(syntax, definition, outcome)  # type: ignore[arg-type]
