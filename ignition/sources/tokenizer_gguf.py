"""Build a Hugging Face tokenizer.json from a GGUF file's tokenizer metadata."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4

# GGUF `tokenizer.ggml.pre` -> the equivalent Hugging Face pre-tokenizer. Only the
# BPE pre-tokenizers verified against their reference tokenizers are listed.
_GPT2 = lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # noqa: E731
_PRE_TOKENIZERS = {
    "gpt2": _GPT2,
    "default": _GPT2,
    # llama.cpp's SMOLLM/STARCODER: every digit alone, then the GPT-2 regex
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _GPT2()]
    ),
    "starcoder": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _GPT2()]
    ),
}


class UnsupportedTokenizer(ValueError):
    pass


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


__all__ = ["tokenizer_from_gguf", "UnsupportedTokenizer"]
