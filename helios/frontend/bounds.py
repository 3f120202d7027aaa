"""Cheap bounds checked before any rendering or tokenization.

Rendering and tokenizing cost time and memory in proportion to the input; a request that
can never fit the context is refused from counts alone: every message and part costs at
least one token, and no token covers more characters than the longest one in the vocabulary
(measured when the frontend starts), so characters / that length is a lower bound on tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from tokenizers import Tokenizer

from helios.frontend.inference import Conversation, RawPrompt, RequestError
from helios.frontend.literal_text import conversation_texts


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the longest token's text (at least 1)."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return max([1] + [len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(vocab)])


@dataclass(frozen=True, slots=True)
class InputBounds:
    max_model_len: int  # tokens in the context
    max_token_chars: int  # the longest token's characters

    def check(self, source: Conversation | RawPrompt) -> None:
        if isinstance(source, RawPrompt):
            if source.token_ids is not None and len(source.token_ids) > self.max_model_len:
                raise RequestError(
                    f"the prompt has {len(source.token_ids)} tokens; the context holds {self.max_model_len}", "prompt"
                )
            self._characters(len(source.text or ""), "prompt")
            return
        messages = source.messages
        parts = sum(len(m.parts) for m in messages)
        if len(messages) > self.max_model_len or parts > self.max_model_len:
            raise RequestError(
                f"the conversation has {len(messages)} messages and {parts} parts; each costs at least "
                f"a token and the context holds {self.max_model_len}",
                "messages",
            )
        if len(source.tools) > self.max_model_len:
            raise RequestError(f"{len(source.tools)} tools cannot fit the {self.max_model_len}-token context", "tools")
        chars = sum(len(text) for text in conversation_texts(source))
        chars += sum(
            len(t.name) + len(t.description or "") + len(msgspec.json.encode(t.parameters)) for t in source.tools
        )
        self._characters(chars, "messages")

    def _characters(self, chars: int, param: str) -> None:
        if chars > self.max_model_len * self.max_token_chars:
            raise RequestError(
                f"the input has {chars} characters; no token covers more than {self.max_token_chars}, "
                f"so it cannot fit the {self.max_model_len}-token context",
                param,
            )
