"""Read a GGUF file: metadata, dequantized tensors (Hugging Face names), tokenizer."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ignition.errors import SourceError
from ignition.models import family, family_of_gguf
from ignition.models.naming import rename
from ignition.sources.checkpoint import Checkpoint, TokenizerFacts, sha256_file
from ignition.sources.gguf_grids import read_grids
from ignition.sources.tokenizer_gguf import UnsupportedTokenizer, tokenizer_from_gguf


def _metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def read_gguf(path: Path, checkpoint_id: str | None) -> Checkpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
        meta = _metadata(reader)
    except Exception as exc:  # the gguf package raises assorted errors on damaged files
        raise SourceError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch = meta.get("general.architecture")
    fam_name = family_of_gguf(str(arch))
    if fam_name is None:
        raise SourceError(f"{path}: GGUF architecture {arch!r} is not supported by this ignition")
    gguf = family(fam_name).gguf
    assert gguf is not None  # family_of_gguf found it by its gguf architectures
    names = {t.name for t in reader.tensors}
    hf_config = gguf.hf_config(meta, names)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        mapped = rename(tensor.name, gguf.weight_map)
        if mapped is None:
            if tensor.name.startswith("rope_freqs"):
                continue
            raise SourceError(f"{path}: unexpected tensor {tensor.name!r} for the {fam_name} family")
        hf_name = mapped[0]
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise SourceError(f"{path}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
            array = array.copy()
        value = torch.from_numpy(array)
        tensors[hf_name] = gguf.tensor_fixup(hf_name, value, hf_config)
    try:
        tokenizer = tokenizer_from_gguf(meta)
    except UnsupportedTokenizer as exc:
        raise SourceError(f"{path}: {exc}") from exc
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    # A family may name end-of-turn tokens llama.cpp recognizes by their text (Gemma's <end_of_turn>).
    turn_ends = [tokenizer.token_to_id(text) for text in gguf.end_of_turn]
    facts = TokenizerFacts(
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(sorted({int(t) for t in (eos, eot, *turn_ends) if t is not None})),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
    return Checkpoint(
        kind="gguf",
        reference=str(path),
        checkpoint_id=checkpoint_id or path.stem,
        name=str(meta.get("general.name") or path.stem),
        family=fam_name,
        hf_config=hf_config,
        tensors=tensors,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_facts=facts,
        # Conversions that drop the template (GGUF-my-repo's Gemma 3) get the family's published one.
        chat_template=meta.get("tokenizer.chat_template") or gguf.chat_template,
        files={path.name: sha256_file(path)},
        dtype=_published_dtype(reader),
        source_format="gguf " + "+".join(sorted({t.tensor_type.name for t in reader.tensors})),
        grids=partial(read_grids, path, gguf.tensor_fixup, partial(_hf_name, gguf.weight_map), hf_config),
    )


def _hf_name(weight_map: Any, gguf_name: str) -> str | None:
    mapped = rename(gguf_name, weight_map)
    return mapped[0] if mapped is not None else None


def _published_dtype(reader: Any) -> str:
    """The precision to export a GGUF at by default: its matrices' own float type, and for
    quantized ones bfloat16, the precision such models are published and run in."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds == {"F32"}:
        return "float32"
    if kinds == {"F16"}:
        return "float16"
    return "bfloat16"
