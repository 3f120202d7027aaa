"""A checkpoint read into memory, whatever its source format."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    add_bos_token: bool


@dataclass(frozen=True)
class Checkpoint:
    kind: str  # "gguf" | "hf-dir" | "hf-cache"
    reference: str  # what the user named
    checkpoint_id: str  # default model id
    name: str  # human-readable name
    family: str  # ignition family handling it
    hf_config: dict[str, Any]  # Hugging Face style config
    tensors: dict[str, Tensor]  # Hugging Face tensor names, dequantized
    tokenizer_json: str
    tokenizer_facts: TokenizerFacts
    chat_template: str | None
    files: dict[str, str]  # source file name -> sha256
    dtype: str = "float32"  # the precision the checkpoint was published in: the export default
    source_format: str = ""  # how the weights were stored, e.g. "gguf Q4_1", "safetensors nvfp4 (modelopt)"
    processor_config: dict[str, Any] | None = (
        None  # preprocessor_config.json / processor_config.json (vision checkpoints)
    )
    # Quantized sources whose blocks an export can keep (GGUF): reads their grids on demand
    # (ignition.sources.gguf_grids.SourceGrids); None: the values are all there is.
    grids: Callable[[], Any] | None = None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
