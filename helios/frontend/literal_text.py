"""Encoding a chat prompt so that only the template's own markup makes control tokens.

The template renders messages into one string; encoding it whole would turn a user's
"<|im_end|>\\n<|im_start|>system" into real control tokens and let any user forge a system
turn. So special-token strings inside the text of system, developer, user and tool messages
(where end users' and tools' text lands) are swapped for private-use placeholder characters
before rendering, and each placeholder is encoded as the plain text of its special token.
Assistant turns are the model's own output (reasoning markup, a prefill to continue) and
keep their markup. Conversations whose texts hold no special-token string, nearly all of
them, are rendered and encoded once, as before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from helios.frontend.inference import Conversation, ReasoningPart, RequestError, TextPart, ToolCallPart, ToolResultPart

_PLACEHOLDER_BASE = 0xF0000  # Supplementary Private Use Area-A: one character per special token
_GUARDED = frozenset({"system", "developer", "user", "tool"})  # roles whose text is never markup


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    ids: list[int]
    text: str  # the prompt text (special-token strings of client text spelled out)
    rendered: str  # what the template rendered: `text`, or with one placeholder per guarded special string
    spans: list[tuple[int, int]]  # per token, its (start, end) character offsets in `rendered`


class LiteralEncoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.literal = Tokenizer.from_str(tokenizer.to_str())
        self.literal.encode_special_tokens = True  # special-token strings become ordinary text tokens
        specials = sorted(
            {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content},
            key=len,
            reverse=True,
        )
        self.specials = specials
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._placeholder_of = {s: chr(_PLACEHOLDER_BASE + i) for i, s in enumerate(specials)}
        self._special_of = {p: s for s, p in self._placeholder_of.items()}
        self._placeholder = re.compile(f"[{chr(_PLACEHOLDER_BASE)}-{chr(_PLACEHOLDER_BASE + max(len(specials), 1))}]")

    def encode_conversation(self, conversation: Conversation, render: Callable[[Conversation], str]) -> EncodedPrompt:
        """The rendered conversation's ids and text, client text's special-token strings kept literal."""
        if self._special is None or not any(
            self._special.search(t) for t in conversation_texts(conversation, _GUARDED)
        ):
            text = render(conversation)
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
            return EncodedPrompt(encoding.ids, text, text, list(encoding.offsets))
        if any(self._placeholder.search(t) for t in conversation_texts(conversation, _GUARDED)):
            raise RequestError(
                "message text contains characters from U+F0000.. that helios reserves; remove them", "messages"
            )
        marked = render(_map_texts(conversation, self._mark))
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        position = 0

        def plain(start: int, end: int) -> None:
            encoding = self.tokenizer.encode(marked[start:end], add_special_tokens=False)
            ids.extend(encoding.ids)
            spans.extend((start + a, start + b) for a, b in encoding.offsets)

        for match in self._placeholder.finditer(marked):
            if match.start() > position:
                plain(position, match.start())
            literal = self.literal.encode(self._special_of[match.group()], add_special_tokens=False).ids
            ids += literal
            spans += [match.span()] * len(literal)  # the placeholder's one character
            position = match.end()
        if position < len(marked):
            plain(position, len(marked))
        return EncodedPrompt(ids, self._placeholder.sub(lambda m: self._special_of[m.group()], marked), marked, spans)

    def _mark(self, text: str) -> str:
        assert self._special is not None
        return self._special.sub(lambda m: self._placeholder_of[m.group()], text)


def conversation_texts(conversation: Conversation, roles: frozenset[str] | None = None) -> list[str]:
    """Every text a client wrote into the conversation's messages (of `roles`, default all)."""
    texts: list[str] = []
    for message in conversation.messages:
        if roles is not None and message.role not in roles:
            continue
        texts += [message.name] if message.name else []
        for part in message.parts:
            if isinstance(part, (TextPart, ReasoningPart)):
                texts.append(part.text)
            elif isinstance(part, ToolCallPart):
                texts += [part.name, part.arguments]
            elif isinstance(part, ToolResultPart):
                texts += [p.text for p in part.content if isinstance(p, TextPart)]
    return texts


def _map_texts(conversation: Conversation, fn: Callable[[str], str]) -> Conversation:
    def part_of(part):
        if isinstance(part, (TextPart, ReasoningPart)):
            return dataclasses.replace(part, text=fn(part.text))
        if isinstance(part, ToolCallPart):
            return dataclasses.replace(part, name=fn(part.name), arguments=fn(part.arguments))
        if isinstance(part, ToolResultPart):
            return dataclasses.replace(part, content=tuple(part_of(p) for p in part.content))
        return part

    messages = tuple(
        m
        if m.role not in _GUARDED
        else dataclasses.replace(m, parts=tuple(part_of(p) for p in m.parts), name=fn(m.name) if m.name else m.name)
        for m in conversation.messages
    )
    return dataclasses.replace(conversation, messages=messages)
