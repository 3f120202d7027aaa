"""Ollama model discovery (GET /api/tags, POST /api/show) for the loaded model.

Everything comes from the core manifest, the model identity and the serving limits; no
field is inferred from the model's name. Generation stays on the OpenAI routes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec

from helios.core.manifest import Manifest
from helios.protocols.models import ModelIdentity

UNKNOWN_TIME = "0001-01-01T00:00:00Z"  # Go's zero time: the modification time is unknown
FORMAT = "flare"


class DiscoveryError(Exception):
    """A discovery failure; the route answers {"error": message} with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True, slots=True)
class Discovery:
    """The loaded model as Ollama clients see it; built per request from immutable inputs."""

    name: str  # the public id, as in /v1/models
    details: dict[str, Any]  # format "flare"; unknown labels are empty
    capabilities: tuple[str, ...]  # "completion" first
    model_info: dict[str, Any]  # general.name, flare.context_length, flare.vocab_size
    digest: str  # sha256 hex over identity and advertised metadata (a cache key, not a manifest digest)


def capabilities(manifest: Manifest) -> tuple[str, ...]:
    """completion, plus what the core prepared: vision graphs, tool and reasoning parsers."""
    found = ["completion"]
    if manifest.capabilities.vision:
        found.append("vision")
    if manifest.recipe.tool_syntax:
        found.append("tools")
    if manifest.recipe.reasoning_syntax:
        found.append("thinking")
    return tuple(found)


_DTYPES = ("weights", "compute", "kv_cache")  # the flare object's precision entries model_info repeats


def discovery(
    model: ModelIdentity, manifest: Manifest, max_model_len: int, precision: dict[str, str] | None = None
) -> Discovery:
    """max_model_len is the effective serving limit (prompt plus output), not the core's; precision
    is the /v1/models flare object's (weights, compute and KV-cache dtypes)."""
    stated = precision or {}
    details = {
        "parent_model": "",
        "format": FORMAT,
        "family": "",
        "families": [],
        "parameter_size": "",
        "quantization_level": manifest.quantization.level if manifest.quantization is not None else "",
    }
    info = {
        "general.name": manifest.model.name or model.public_id,
        "flare.context_length": max_model_len,
        "flare.vocab_size": manifest.tokenizer.vocab_size,
        **{f"flare.{part}_dtype": stated[part] for part in _DTYPES if part in stated},
    }
    caps = capabilities(manifest)
    weights = manifest.files.get(manifest.weights.file, "")
    keyed = {
        "identity": {
            "public_id": model.public_id,
            "checkpoint_id": model.checkpoint_id,
            "aliases": model.aliases,
            "source": manifest.model.source.files,
            "weights": weights,
        },
        "details": details,
        "capabilities": caps,
        "model_info": info,
    }
    digest = hashlib.sha256(msgspec.json.encode(keyed, order="sorted")).hexdigest()
    return Discovery(model.public_id, details, caps, info, digest)


def tags(found: Discovery) -> dict[str, Any]:
    """GET /api/tags: one entry; size and modification time are unknown (0, Go zero time)."""
    entry = {
        "name": found.name,
        "model": found.name,
        "modified_at": UNKNOWN_TIME,
        "size": 0,
        "digest": found.digest,
        "details": found.details,
    }
    return {"models": [entry]}


def show(found: Discovery) -> dict[str, Any]:
    """POST /api/show: verbose or not, the same metadata; no template or tensor inventory."""
    return {
        "modified_at": UNKNOWN_TIME,
        "details": found.details,
        "model_info": found.model_info,
        "capabilities": list(found.capabilities),
    }


def decode_show(body: Any) -> str:
    """The requested name; 400 for a missing, empty or mistyped name or a mistyped verbose."""
    if not isinstance(body, dict):
        raise DiscoveryError(400, 'the request body must be a JSON object like {"model": "NAME"}')
    name = body.get("model")
    if name is None:
        raise DiscoveryError(400, "model is required")
    if not isinstance(name, str):
        raise DiscoveryError(400, f"model must be a string, got {type(name).__name__}")
    if not name:
        raise DiscoveryError(400, "model must not be empty")
    verbose = body.get("verbose")
    if verbose is not None and not isinstance(verbose, bool):
        raise DiscoveryError(400, f"verbose must be a boolean, got {type(verbose).__name__}")
    return name
