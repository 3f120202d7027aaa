"""Per-token bytes against the tokenizers library's own decoding, and UTF-8 hold-back."""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from helios.frontend.detokenizer import IncrementalDecoder, TokenBytes, byte_level_alphabet
from ignition.testmodel import build_tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SAMPLES = ["Hello world", "héllo wörld\n\t  x", "emoji 😀 and 中文 text", " spaced out  ", "a<|im_end|>b"]


def _sentencepiece(decoder: decoders.Decoder) -> Tokenizer:
    """A tiny Llama-style tokenizer: '▁' word marker, <0xNN> byte fallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁hello", "▁world", "h", "e", "l", "o", "w", "r", "d", "▁h"]:
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoder
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tokenizer


def test_byte_level_alphabet_is_the_tokenizers_alphabet() -> None:
    table = byte_level_alphabet()
    assert set(table) == set(ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A


def test_byte_level_bytes_concatenate_to_the_text() -> None:
    tokenizer = build_tokenizer(SPECIALS)
    tokens = TokenBytes(tokenizer)
    for text in SAMPLES:
        ids = tokenizer.encode(text).ids
        assert b"".join(tokens.bytes_of(i) for i in ids) == text.encode()
        assert b"".join(tokens.bytes_of(i) for i in ids).decode() == tokenizer.decode(ids, skip_special_tokens=False)


def test_every_token_matches_single_token_decoding() -> None:
    tokenizer = build_tokenizer(SPECIALS)
    tokens = TokenBytes(tokenizer)
    for token_id in range(tokenizer.get_vocab_size()):
        expected = tokenizer.decode([token_id], skip_special_tokens=False)
        assert tokens.bytes_of(token_id).decode("utf-8", errors="replace") == expected
    assert tokens.bytes_of(10**6) == b""  # padded embedding rows beyond the tokenizer


def test_special_tokens() -> None:
    tokenizer = build_tokenizer(SPECIALS)
    tokens = TokenBytes(tokenizer)
    end = tokenizer.token_to_id("<|im_end|>")
    assert tokens.is_special(end) and tokens.bytes_of(end) == b"<|im_end|>"
    assert not tokens.is_special(tokenizer.token_to_id("Ġ"))
    assert not tokens.strips_leading_space


def test_sentencepiece_sequence_decoder() -> None:
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    decoder = decoders.Sequence(steps)
    tokenizer = _sentencepiece(decoder)
    tokens = TokenBytes(tokenizer)
    assert tokens.strips_leading_space
    for text in ["hello world", "hello wörld 😀", "hello  héllo"]:
        ids = tokenizer.encode(text).ids
        joined = b"".join(tokens.bytes_of(i) for i in ids)
        assert joined == (" " + text).encode()  # the sequence-start strip is the caller's business
        assert joined.decode()[1:] == tokenizer.decode(ids)
    assert tokens.bytes_of(tokenizer.token_to_id("<0xC3>")) == b"\xc3"
    assert tokens.bytes_of(tokenizer.token_to_id("▁world")) == b" world"
    assert tokens.is_special(tokenizer.token_to_id("</s>"))


def test_metaspace_decoder() -> None:
    tokenizer = _sentencepiece(decoders.Metaspace())
    tokens = TokenBytes(tokenizer)
    assert tokens.strips_leading_space
    assert tokens.bytes_of(tokenizer.token_to_id("▁hello")) == b" hello"
    never = TokenBytes(_sentencepiece(decoders.Metaspace(prepend_scheme="never")))
    assert not never.strips_leading_space


def test_incremental_decoder_holds_incomplete_utf8() -> None:
    decoder = IncrementalDecoder()
    emoji = "😀".encode()
    assert [decoder.push(emoji[i : i + 1]) for i in range(4)] == ["", "", "", "😀"]
    assert decoder.push(b"a\xff") == "a\ufffd"  # invalid bytes are replaced at once
    assert decoder.push(emoji[:2]) == ""
    assert decoder.flush() == "\ufffd"


def test_incremental_decoder_matches_lossy_decoding_for_any_split() -> None:
    data = "mixed ünïcödé 😀 中文".encode() + b"\xff\xe4\xb8" + b"end"
    for seed in range(50):
        rng = random.Random(seed)
        decoder = IncrementalDecoder()
        cuts = sorted(rng.sample(range(1, len(data)), 8))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        text = "".join(decoder.push(piece) for piece in pieces) + decoder.flush()
        assert text == data.decode("utf-8", errors="replace")
