"""Build a Hugging Face tokenizer.json from a GGUF file's tokenizer metadata."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4

# Architectures whose sentencepiece (`llama`) vocabulary is Gemma's: BPE with byte fallback,
# spaces as "▁", no prefix space (transformers' GemmaTokenizer, and its GGUF gemma_tokenizer).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# GGUF `tokenizer.ggml.pre` -> the equivalent Hugging Face pre-tokenizer. Only the
# BPE pre-tokenizers verified against their reference tokenizers are listed.
_GPT2 = lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # noqa: E731
_PRE_TOKENIZERS = {
    "gpt2": _GPT2,
    "default": _GPT2,
    # llama.cpp's SMOLLM/STARCODER: every digit alone, then the GPT-2 regex
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _GPT2()]),
    "starcoder": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _GPT2()]),
}


class UnsupportedTokenizer(ValueError):
    pass


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama" and meta.get("general.architecture") in _GEMMA_ARCHITECTURES:
        return _with_bos(_gemma_tokenizer(meta), meta)
    if kind != "gpt2":
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE, and Gemma's "
            "sentencepiece vocabulary)"
        )
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
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return _with_bos(tokenizer, meta)


def _with_bos(tokenizer: Tokenizer, meta: dict[str, Any]) -> Tokenizer:
    """Prepend BOS when encoding with special tokens, if the file asks for it."""
    tokens = meta["tokenizer.ggml.tokens"]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    return tokenizer


def _gemma_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Gemma's sentencepiece BPE rebuilt the way transformers' GGUF loader does (gemma_tokenizer):

    * tokens made only of spaces are stored as real spaces but looked up as "▁"s: respell them;
    * the file lists no merges, so they are derived from the vocabulary: every split of a token
      into two tokens is a merge, ranked by the token's position in the file (Gemma's scores do
      not follow its merge order), ties by longer left, then longer right piece.
    """
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_position(tokens, vocab),
            fuse_unk=True,
            unk_token=tokens[unk] if unk is not None else "<unk>",
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in range(len(tokens)) if types[i] == _CONTROL]
    )
    # llama.cpp matches user-defined tokens (runs of newlines, ...) whole in the text.
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i in range(len(tokens))
            if types[i] == _USER_DEFINED and tokens[i] in vocab
        ]
    )
    return tokenizer


def _merges_by_position(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' generate_merges with -position as each token's score."""
    rank = {token: -index for index, token in enumerate(tokens)}  # a repeated token keeps its last position
    merges: list[tuple[str, str, int]] = []
    for merged, score in rank.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


__all__ = ["tokenizer_from_gguf", "UnsupportedTokenizer"]
