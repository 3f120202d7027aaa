"""Read a Hugging Face-format checkpoint directory (or a repo id from the local HF cache)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ignition.errors import SourceError
from ignition.models import family_of_hf_config
from ignition.sources.checkpoint import Checkpoint, TokenizerFacts, sha256_file
from ignition.sources.quantized import dequantize, source_format

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path}: cannot read JSON ({exc})") from exc


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    standalone = directory / "chat_template.jinja"
    if standalone.is_file():
        return standalone.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def read_hf_dir(
    directory: Path, kind: str = "hf-dir", reference: str | None = None, checkpoint_id: str | None = None
) -> Checkpoint:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{directory}: no config.json, so this is not a Hugging Face checkpoint directory")
    config = _read_json(config_path)
    fam_name = family_of_hf_config(config)
    if fam_name is None:
        archs = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
        raise SourceError(f"{directory}: architecture {archs} is not supported by this ignition")
    quantized = source_format(config)
    stored: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        try:
            stored.update(load_file(str(path)))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise SourceError(f"{path}: corrupted or unreadable safetensors file ({exc})") from exc
    tensors = dequantize(stored, config)
    del stored
    if quantized:  # the tensors are floats now: families read the config of what they hold
        config = {key: value for key, value in config.items() if key != "quantization_config"}
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SourceError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:
        raise SourceError(f"{tokenizer_path}: not a valid tokenizer ({exc})") from exc
    tok_config = (
        _read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
    )
    gen_config = (
        _read_json(directory / "generation_config.json") if (directory / "generation_config.json").is_file() else {}
    )

    def token_id(key: str, config_key: str) -> int | None:
        content = _token_content(tok_config.get(key))
        if content is not None and tokenizer.token_to_id(content) is not None:
            return tokenizer.token_to_id(content)
        value = gen_config.get(config_key, config.get(config_key))
        return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None

    eos_ids: set[int] = set()
    for source in (gen_config.get("eos_token_id"), config.get("eos_token_id")):
        eos_ids.update(source if isinstance(source, list) else [source] if isinstance(source, int) else [])
    if (eos := token_id("eos_token", "eos_token_id")) is not None:
        eos_ids.add(eos)
    bos = token_id("bos_token", "bos_token_id")
    facts = TokenizerFacts(
        bos_token_id=bos,
        eos_token_ids=tuple(sorted(eos_ids)),
        pad_token_id=token_id("pad_token", "pad_token_id"),
        add_bos_token=bool(tok_config.get("add_bos_token", False)) and bos is not None,
    )
    files = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}
    processor = next(
        (
            _read_json(directory / n)
            for n in ("processor_config.json", "preprocessor_config.json")
            if (directory / n).is_file()
        ),
        None,
    )
    name = str(config.get("_name_or_path") or directory.name)
    return Checkpoint(
        kind=kind,
        reference=reference or str(directory),
        checkpoint_id=checkpoint_id or directory.name,
        name=name,
        family=fam_name,
        hf_config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        tokenizer_facts=facts,
        chat_template=_chat_template(directory, tok_config),
        files=files,
        dtype=_published_dtype(config, tensors, quantized is not None),
        source_format="safetensors" + (f" {quantized}" if quantized else ""),
        processor_config=processor,
    )


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights: every shard the index names (all present),
    else every *.safetensors file in the directory."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{index_path}: no weight_map, so the shards cannot be found")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise SourceError(
                f"{directory}: {len(missing)} of the {len(shards)} shards {INDEX_FILE} lists are missing "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): finish the download"
            )
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{directory}: no *.safetensors weight files (other weight formats are not supported)")
    return files


def resolve_hf_cache(repo_id: str) -> Path:
    """The local snapshot directory of a cached repo id; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        raise SourceError(
            f"{repo_id!r} is neither a file, a directory, nor a repo id in the local Hugging Face cache "
            f"(downloads are disabled; fetch it on a connected machine with `hf download {repo_id}`)"
        ) from exc
    except Exception as exc:  # huggingface_hub validation errors for malformed ids
        raise SourceError(f"{repo_id!r} is not a usable source: {exc}") from exc


def _published_dtype(config: dict, tensors: dict[str, torch.Tensor], quantized: bool = False) -> str:
    """The checkpoint's own precision: config.json's dtype (torch_dtype before transformers 5),
    else its stored floating-point tensors' (float32 where neither says bfloat16 or float16);
    a quantized checkpoint that declares none exports as bfloat16, like a quantized GGUF."""
    declared = str(config.get("dtype") or config.get("torch_dtype") or "")
    if declared in ("bfloat16", "float16", "float32"):
        return declared
    if quantized:
        return "bfloat16"
    stored = {t.dtype for t in tensors.values() if t.is_floating_point()}
    for dtype in (torch.bfloat16, torch.float16):
        if stored == {dtype}:
            return str(dtype).removeprefix("torch.")
    return "float32"
