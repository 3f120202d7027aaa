"""Model discovery cards: GET /v1/models and /v1/models/{id} (vLLM-compatible + `flare`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from helios.core.manifest import Manifest, Quantization
from helios.core.sampling import DISTRIBUTION_PARAMS


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    public_id: str  # first nonempty configured alias, else the checkpoint id
    checkpoint_id: str
    aliases: tuple[str, ...]
    created: int  # discovery initialization time, stable until restart

    def matches(self, name: str) -> bool:
        return bool(name) and (name == self.checkpoint_id or name in self.aliases or name == self.public_id)


def identity(manifest: Manifest, configured_aliases: tuple[str, ...], created: int) -> ModelIdentity:
    aliases = tuple(a for a in (*configured_aliases, *manifest.model.aliases) if a)
    return ModelIdentity(aliases[0] if aliases else manifest.model.id, manifest.model.id, aliases, created)


IMAGE_LIMITS = (
    "max_images_per_prompt",
    "max_image_tokens_per_prompt",
    "image_feature_window_tokens",
    "max_image_tokens_per_image",
    "max_image_pixels",
    "max_image_bytes",
)


def precision(manifest: Manifest, upcast_from: str | None, weights_in_memory: str = "") -> dict[str, str]:
    """The core's weight precision, what the engine holds and computes in, and what its logprobs
    are: a 16-bit core this CPU runs upcast computes (and keeps its KV cache) in float32; matmuls
    accumulate in float32 throughout. weights is the stored precision: a quantized core's level
    (e.g. "int4-g32"), else the float dtype; weights_in_memory what the engine holds (the level
    where its native kernels run the stored values, the float dtype a quantized weight was
    dequantized to elsewhere). A bfloat16 core's logprobs differ from a float32 export of the same
    weights, a quantized core's from the unquantized checkpoint's (docs/serving.md, docs/quantization.md)."""
    upcast = upcast_from is not None
    compute = "float32" if upcast else manifest.weights.dtype
    quantization = manifest.quantization
    stored = quantization.level if quantization is not None else manifest.weights.dtype
    held = weights_in_memory or (compute if quantization is None else stored)
    return {
        "weights": stored,
        "weights_in_memory": held,
        "compute": compute,
        "kv_cache": "float32" if upcast else manifest.kv.dtype,
        "accumulation": "float32",
        "logprobs": _logprob_statement(quantization, stored, held, compute),
    }


def _logprob_statement(quantization: Quantization | None, stored: str, held: str, compute: str) -> str:
    """What the reported logprobs are the distribution of, in a sentence."""
    arithmetic = f"{compute} activations, float32 accumulation"
    if quantization is None:
        if stored == "float32":
            return "the float32 model's own distribution (float32 arithmetic throughout)"
        return (
            f"the {stored} weights' distribution ({arithmetic}); a float32 export of the same checkpoint "
            "differs by up to a few tenths of a nat"
        )
    check = quantization.self_check
    measured = (
        f"export self-check: max |Δ logprob| {check.max_abs_logprob_diff:.3g}, top-1 agreement "
        f"{check.top1_agreement:.1%}, perplexity {check.perplexity:.4g} vs {check.reference_perplexity:.4g}"
        if check is not None
        else "not measured at export"
    )
    values = "its stored values" if held == stored else f"its values rounded to {held} at load"
    return (
        f"the {stored} quantized weights' distribution, computed on {values} ({arithmetic}); it differs "
        f"from the unquantized checkpoint's ({measured})"
    )


def flare_object(
    manifest: Manifest,
    *,
    max_concurrency: int,
    prefill_chunk_size: int,
    default_max_tokens: int,
    thinking_token_budget: int | None,
    image_limits: dict[str, int] | None = None,
    device: str = "cpu",
    cuda_graphs: bool = False,
    upcast_from: str | None = None,
    weights_in_memory: str = "",
) -> dict[str, Any]:
    """default_max_tokens is the effective integer budget of a request that omits one (never null).
    image_limits: the six image fields at the served context (vision cores; zeros without).
    device: the device the engine runs on ("cpu", "cuda", "cuda:N"); cuda_graphs: whether decode steps
    replay captured CUDA graphs (never on CPU); upcast_from: the 16-bit weight dtype run as float32 here;
    weights_in_memory: the weight precision the engine holds (EngineMetrics.weights_in_memory).
    api.md names none of these: docs/serving.md documents them."""
    spec = manifest.recipe.sampling
    defaults = {name: getattr(spec.defaults, name) for name in DISTRIBUTION_PARAMS}
    defaults["seed"] = spec.defaults.seed
    ranges = {
        name: ({"min": spec.ranges[name].min, "max": spec.ranges[name].max} if name in spec.ranges else None)
        for name in DISTRIBUTION_PARAMS
    }
    return {
        "vocab_size": manifest.tokenizer.vocab_size,
        "max_top_logprobs": manifest.capabilities.max_top_logprobs,
        "max_concurrency": max_concurrency,
        "prefill_chunk_size": prefill_chunk_size,
        "default_max_tokens": default_max_tokens,
        "sampling_defaults": defaults,
        "thinking_token_budget": thinking_token_budget,
        "sampling_ranges": ranges,
        **{name: (image_limits or {}).get(name, 0) for name in IMAGE_LIMITS},
        "input_modalities": ["text"] + (["image"] if manifest.capabilities.vision else []),
        "output_modalities": ["text"],
        "device": device,
        "cuda_graphs": cuda_graphs,
        "precision": precision(manifest, upcast_from, weights_in_memory),
    }


def card(model: ModelIdentity, manifest: Manifest, max_model_len: int, flare: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": model.public_id,
        "object": "model",
        "created": model.created,
        "owned_by": "local",
        "root": model.checkpoint_id,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{model.created:x}",
                "object": "model_permission",
                "created": model.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": manifest.capabilities.max_top_logprobs > 0,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
        "flare": flare,
    }
