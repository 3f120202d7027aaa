"""Candidate prefix-checkpoint boundaries from a rendered conversation's structure.

The engine's hybrid cores snapshot recurrent state at chosen prompt positions
(engine/checkpoints.py); this module says which positions the prompt's structure makes worth
it: the conversation anchor (the end of the leading system + tools block), message ends, and
the ends of blocks a client marked with cache_control. Positions are found, never guessed:
  * the end of the first k messages is where the template's rendering of those messages alone
    (no generation prompt) stops, when that rendering is a prefix of the whole prompt;
  * a template that cannot render that prefix (one that refuses a conversation without a user
    turn) or renders it differently gets the longest prefix the prompt shares with two renders
    continuing the same k messages with a probe message of the next message's role: the part
    every such continuation shares, which is what a later prompt can reuse;
  * a marked block's end is found by its text, which must occur exactly once in its message's
    rendered span (templates render content verbatim or trimmed; otherwise it is dropped);
  * a character offset becomes a token position only where the prompt's tokenization has a
    token boundary exactly there.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from helios.core.template import TemplateError
from helios.frontend.inference import Message, TextPart, ToolResultPart

MAX_MESSAGE_HINTS = 4  # message ends hinted per prompt: the latest ones (longest reusable prefixes)
_PROBES = ("\x01probe-a", "\x02probe-b")  # contents that differ from each other at their first character


@dataclass(frozen=True, slots=True)
class Rendering:
    """One rendered conversation, as hint finding needs it."""

    text: str  # the rendered prompt (the text its token spans index)
    messages: list[Message]  # the arranged messages, parallel to `dicts`
    dicts: list[dict]  # the template messages they became
    render: Callable[[list[dict]], str]  # the same template, tools and kwargs, without a generation prompt
    tools: bool  # tools are presented (they belong to the anchor's block)


def character_hints(
    rendering: Rendering, marks: Sequence[tuple[Message, int]], anchor_only: bool = False
) -> list[tuple[int, str]]:
    """(character offset, role) candidates: the anchor, the last MAX_MESSAGE_HINTS message ends, and
    each marked (message, part index) block's end (with anchor_only, the anchor alone); those that
    cannot be located are left out."""
    text, dicts = rendering.text, rendering.dicts
    ends: dict[int, int | None] = {}

    def end_of(k: int) -> int | None:  # where the first k messages end in `text`
        if k not in ends:
            ends[k] = _end_of(rendering, k)
        return ends[k]

    hints: list[tuple[int, str]] = []
    lead = 1 if dicts and dicts[0].get("role") == "system" else 0
    if lead or rendering.tools:
        anchor = end_of(lead)
        if anchor:
            hints.append((anchor, "anchor"))
    if anchor_only:
        return hints
    for k in range(max(lead + 1, len(dicts) - MAX_MESSAGE_HINTS + 1), len(dicts) + 1):
        end = end_of(k)
        if end:
            hints.append((end, "message"))
    index_of = {id(m): i for i, m in enumerate(rendering.messages)}
    for message, part in marks:
        i = index_of.get(id(message))
        if i is not None:
            end = _block_end(rendering, i, part, end_of(i) or 0, end_of(i + 1) or len(text))
            if end:
                hints.append((end, "cache_control"))
    return hints


def token_hints(hints: Sequence[tuple[int, str]], spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, str], ...]:
    """The hints whose character offset is a token boundary, as (prefix length in tokens, role)."""
    ends = [end for _, end in spans]
    if any(b < a for a, b in zip(ends, ends[1:])):
        return ()  # offsets that are not monotonic cannot be mapped exactly
    out: dict[tuple[int, str], None] = {}
    for offset, role in hints:
        count = bisect.bisect_right(ends, offset)  # tokens ending at or before the offset
        if count and ends[count - 1] == offset and (count == len(spans) or spans[count][0] >= offset):
            out[(count, role)] = None
    return tuple(out)


def _end_of(rendering: Rendering, k: int) -> int | None:
    text, dicts = rendering.text, rendering.dicts
    try:
        prefix = rendering.render(dicts[:k])
        if prefix and text.startswith(prefix):
            return len(prefix)
    except TemplateError:
        pass
    role = dicts[k].get("role") if k < len(dicts) else None
    if role not in ("user", "system"):
        return None  # probes of other roles would need their calls or results
    shared = len(text)
    try:
        for probe in _PROBES:
            probed = rendering.render([*dicts[:k], {"role": role, "content": probe}])
            shared = len(os.path.commonprefix([text[:shared], probed]))
    except TemplateError:
        return None
    return shared or None


def _block_end(rendering: Rendering, index: int, part: int, lo: int, hi: int) -> int | None:
    """Where marked part `part` of message `index` ends, within that message's span [lo, hi)."""
    message = rendering.messages[index]
    content = rendering.dicts[index].get("content")
    if not isinstance(content, str) or not 0 <= part < len(message.parts):
        return None
    block = message.parts[part]
    if isinstance(block, ToolResultPart):
        through = content  # a tool message's content is its one result
    elif isinstance(block, TextPart):
        through = "\n\n".join(p.text for p in message.parts[: part + 1] if isinstance(p, TextPart))
        if not content.startswith(through):
            return None
    else:
        return None
    span = rendering.text[lo:hi]
    for whole, upto in ((content, through), (content.strip(), through.lstrip())):
        if whole and span.count(whole) == 1:
            return lo + span.index(whole) + min(len(upto), len(whole))
    return None
