"""What a reasoning budget needs from a family's syntaxes (spec: thinking_token_budget).

Where output starts: inside reasoning when the prepared prompt leaves it open (the same reading
the output parser makes of the prompt). What ends reasoning besides the close: a tool call the
parser finds in reasoning. Openers that always start a call end it at once (DeepSeek's DSML
token); openers a syntax decides on the text that follows (Qwen's <tool_call>) go through a gate
the engine asks before it forces the close.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tokenizers import Tokenizer

from helios.frontend.inference import ToolSpec
from helios.frontend.parsers import deepseek
from helios.frontend.parsers.envelope import OUTSIDE, ToolCallError, ToolParser
from helios.frontend.parsers.markup import Marks, Span, partial_tail
from helios.frontend.parsers.reasoning import SYNTAXES, prompt_opens
from helios.frontend.parsers.tools import SYNTAXES as TOOL_SYNTAXES
from helios.frontend.parsers.tools import tool_parser


def output_starts_in_reasoning(tokenizer: Tokenizer, syntax: str, prompt_ids: tuple[int, ...]) -> bool:
    """Whether output starts inside reasoning: the prepared prompt left it open."""
    if syntax == deepseek.REASONING_SYNTAX:
        return deepseek.output_start(tokenizer, prompt_ids)[0]
    delimiters = SYNTAXES.get(syntax)
    if delimiters is None:
        return False
    return prompt_opens(delimiters, Marks(tokenizer, delimiters.spellings), tokenizer, prompt_ids)


class ToolOpenerGate:
    """The engine's ReasoningGate for a syntax whose tool openers count in reasoning: the family's
    tool parser reads the choice's output (all reasoning while the engine asks). A forced close
    may follow only while no opener waits for the text that decides it, none is partly written,
    and no call has ended reasoning."""

    def __init__(self, tokenizer: Tokenizer, make_parser: Callable[[], ToolParser]) -> None:
        self._tokenizer = tokenizer
        self._make_parser = make_parser
        self._parser: ToolParser | None = None  # made when first asked (the request's copy never is)
        self._read = 0  # output tokens read
        self._ended = False  # a call began in reasoning (or broke): nothing is left to close

    def fork(self) -> ToolOpenerGate:
        return ToolOpenerGate(self._tokenizer, self._make_parser)

    def allows_close(self, token_ids: Sequence[int], start: int) -> bool:
        parser = self._parser = self._parser or self._make_parser()
        if not self._ended and start + self._read < len(token_ids):
            new = token_ids[start + self._read :]
            self._read += len(new)
            try:
                parser.feed([Span("reasoning", parser.marks.encode_ids(self._tokenizer, new))])
            except ToolCallError:
                self._ended = True  # the output pipeline reports the broken call
            self._ended = self._ended or parser.ended_reasoning or parser.state != OUTSIDE
        if self._ended or parser.undecided:
            return False
        return partial_tail(parser.held.text, parser.openers("reasoning")) is None


def tool_exits(
    tokenizer: Tokenizer, syntax: str, tools: Iterable[ToolSpec]
) -> tuple[frozenset[int], ToolOpenerGate | None]:
    """(tokens that always end reasoning, the gate for openers decided later) of a request whose
    tools are on; a syntax that reads no calls in reasoning has neither."""
    if syntax == deepseek.TOOL_SYNTAX:  # a DSML token in reasoning always starts the calls block
        dsml = tokenizer.token_to_id(deepseek.DSML)
        return (frozenset() if dsml is None else frozenset((dsml,))), None
    entry = TOOL_SYNTAXES.get(syntax)
    if entry is None or not getattr(entry[1], "scans_reasoning", False):
        return frozenset(), None
    spellings, specs = entry[0], tuple(tools)

    def make() -> ToolParser:
        parser = tool_parser(syntax, tokenizer, specs, Marks(tokenizer, spellings))
        assert parser is not None  # a syntax of TOOL_SYNTAXES
        return parser

    return frozenset(), ToolOpenerGate(tokenizer, make)
