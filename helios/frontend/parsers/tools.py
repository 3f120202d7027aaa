"""Tool-call syntaxes by name: each family's parser module, built for one request.

The engine and its errors live in `envelope`; they are re-exported here for callers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenizers import Tokenizer

from helios.frontend.inference import ToolSpec
from helios.frontend.parsers import gemma4, glm47, hermes, kimi3, minimax_m3, qwen3_coder
from helios.frontend.parsers.envelope import MAX_ARGUMENT_BYTES, ToolCallError, ToolParser, new_call_id
from helios.frontend.parsers.markup import Marks
from helios.frontend.parsers.schema import ToolSchemas

__all__ = [
    "MAX_ARGUMENT_BYTES",
    "SYNTAXES",
    "ToolCallError",
    "ToolParser",
    "new_call_id",
    "tool_opener_ids",
    "tool_parser",
]

# Syntax name -> (delimiter spellings matched by token when the vocabulary has them, parser class).
SYNTAXES: dict[str, tuple[tuple[str, ...], Callable[[Marks, ToolSchemas], ToolParser]]] = {
    "hermes": (hermes.SPELLINGS, hermes.HermesParser),
    "qwen3_coder": (qwen3_coder.SPELLINGS, qwen3_coder.Qwen3CoderParser),
    "mimo": (qwen3_coder.SPELLINGS, qwen3_coder.MimoParser),
    "glm47": (glm47.SPELLINGS, glm47.Glm47Parser),
    "gemma4": (gemma4.SPELLINGS, gemma4.Gemma4Parser),
    "minimax_m3": (minimax_m3.SPELLINGS, minimax_m3.MiniMaxM3Parser),
    "kimi3": (kimi3.SPELLINGS, kimi3.Kimi3Parser),
}


# The token that opens a call, where a syntax has one that cannot mean anything else.
OPENERS = {
    "hermes": "<tool_call>",
    "qwen3_coder": "<tool_call>",
    "mimo": "<tool_call>",
    "glm47": "<tool_call>",
    "minimax_m3": "<tool_call>",
    "gemma4": "<|tool_call>",
}


def tool_opener_ids(syntax: str, tokenizer: Tokenizer) -> frozenset[int]:
    """The single-token call opener of a syntax, when the vocabulary has it as one token."""
    token = tokenizer.token_to_id(OPENERS[syntax]) if syntax in OPENERS else None
    return frozenset() if token is None else frozenset((token,))


def tool_spellings(syntax: str) -> tuple[str, ...]:
    return SYNTAXES[syntax][0] if syntax in SYNTAXES else ()


def tool_parser(
    syntax: str, tokenizer: Tokenizer, tools: Iterable[ToolSpec] = (), marks: Marks | None = None
) -> ToolParser | None:
    """The parser for one request's tool calls; `tools` guide argument conversion."""
    entry = SYNTAXES.get(syntax)
    if entry is None:
        return None
    spellings, parser = entry
    return parser(marks or Marks(tokenizer, spellings), ToolSchemas(tools))
