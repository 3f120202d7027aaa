"""Token ids to exact bytes, and bytes to text released as soon as it is valid UTF-8.

Every token's contribution is computed per id (no decoding of whole sequences), so
streaming output never re-decodes earlier tokens and logprob entries get exact bytes.
"""

from __future__ import annotations

import codecs
import json
import re

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: printable stand-in char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


class TokenBytes:
    """The exact bytes each token contributes to decoded text, cached per id.

    ByteLevel decoders map every char through the byte alphabet; SentencePiece-style
    decoders (Replace '▁' -> ' ', ByteFallback, Fuse, Strip, or Metaspace) replace the
    word marker and read <0xNN> tokens as single bytes. The one context effect the
    latter have, stripping a space at the very start of a sequence, is not applied:
    generated text follows a prompt. `strips_leading_space` says whether it exists.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        spec = json.loads(tokenizer.to_str())
        self._added: dict[int, str] = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
        self._special = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        self._byte_level: dict[str, int] | None = None
        self._byte_fallback = False
        self._replacements: list[tuple[str, str]] = []
        self.strips_leading_space = False  # the decoder drops one leading " " of a whole sequence
        self._generic = False  # unknown decoder: fall back to decoding the single token
        self._read_decoder(spec.get("decoder"))
        self._cache: dict[int, bytes] = {}

    def _read_decoder(self, decoder: dict | None) -> None:
        if decoder is None:
            self._generic = True
            return
        kind = decoder.get("type")
        if kind == "Sequence":
            for step in decoder.get("decoders", []):
                self._read_decoder(step)
        elif kind == "ByteLevel":
            self._byte_level = byte_level_alphabet()
        elif kind == "ByteFallback":
            self._byte_fallback = True
        elif kind == "Replace" and "String" in decoder.get("pattern", {}):
            self._replacements.append((decoder["pattern"]["String"], decoder["content"]))
        elif kind == "Strip":
            self.strips_leading_space = decoder.get("content") == " " and decoder.get("start", 0) > 0
        elif kind == "Metaspace":
            self._replacements.append((decoder.get("replacement", "▁"), " "))
            scheme = decoder.get("prepend_scheme", "always" if decoder.get("add_prefix_space", True) else "never")
            self.strips_leading_space = scheme != "never"
        elif kind != "Fuse":
            self._generic = True

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        """Added tokens marked special (control tokens hidden by skip_special_tokens)."""
        return token_id in self._special

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes this token contributes to text; b"" for ids outside the vocabulary."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute(token_id)
            self._cache[token_id] = cached
        return cached

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._generic:
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level is not None:
            alphabet = self._byte_level
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
            return piece.encode()  # as the ByteLevel decoder does for off-alphabet tokens
        if self._byte_fallback and (match := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        for pattern, content in self._replacements:
            piece = piece.replace(pattern, content)
        return piece.encode()


class IncrementalDecoder:
    """UTF-8 bytes in, text out; an incomplete trailing sequence waits for its rest."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        """Text completed by these bytes (invalid bytes become U+FFFD at once)."""
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """Whatever is still held, with U+FFFD for an incomplete sequence."""
        return self._decoder.decode(b"", final=True)
