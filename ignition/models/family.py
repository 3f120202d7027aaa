"""The contract between ignition and an architecture family: one frozen `Family` value per family.

Each family module ends with `FAMILY = Family(...)`; ignition.models' registry maps names to those
values, and export, testmodel and the sources read only their fields. `config` below is the value the
family's `config_from_hf` returns (each family has its own frozen config class).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from helios.core.manifest import TensorSpec, VisionProfile
from ignition.models import common

Config = Any  # a family's frozen config, as its config_from_hf returns it


@dataclass(frozen=True, slots=True)
class PromptImages:
    """Image features in a reference forward's prompt: row i of `features` replaces the input
    embedding at prompt position `positions[i]`."""

    features: Tensor  # [N, width]
    positions: tuple[int, ...]  # N prompt positions

    def __post_init__(self) -> None:
        if len(self.features) != len(self.positions):
            raise ValueError(f"{len(self.features)} image feature rows for {len(self.positions)} image positions")

    def splice(self, x: Tensor) -> Tensor:
        """x [T, width], its rows at the image positions replaced by the features (in x's dtype, in place)."""
        if self.positions:
            x[torch.tensor(self.positions)] = self.features.to(x.dtype)
        return x


@dataclass(frozen=True, slots=True)
class Reference:
    """The family's independent plain-torch forward(s) the export self-check compares the saved
    programs against (fp32 or float64, unpaged, over Hugging Face-named weights)."""

    # (config, hf_weights, token_ids) -> logits [T, V]; a vision family's also takes
    # `images: PromptImages | None` after token_ids.
    logits: Callable[..., Tensor]
    # Vision families only: (config, hf_weights, pixels, positions) -> image features [N, width].
    features: Callable[[Config, dict[str, Tensor], Tensor, Tensor], Tensor] | None = None

    @property
    def module(self) -> str:
        """The module that holds the reference forward (e.g. ignition.models.qwen3_next_reference)."""
        return self.logits.__module__


@dataclass(frozen=True, slots=True)
class Vision:
    """The export hooks of a family whose checkpoints may carry a vision tower; a config's tower is
    its `vision` field (None: a text-only checkpoint of that family)."""

    # config -> the `vision` program module (one image's patches -> feature rows).
    program: Callable[[Config], torch.nn.Module]
    # config -> (pixel_values [X, patch], pixel_positions [X, 2]) tracing and self-check inputs.
    examples: Callable[[Config], tuple[Tensor, Tensor]]
    # (config, processor_config dict, max_model_len, token_id(text) -> id | None) -> the core's image profile;
    # ValueError for an unsupported processor config.
    profile: Callable[[Config, dict[str, Any], int, Callable[[str], int | None]], VisionProfile]
    # Gemma 4: whether a config's image tokens attend both ways (the step takes attention_until). None: never.
    bidirectional: Callable[[Config], bool] | None = None


@dataclass(frozen=True, slots=True)
class TinyVision:
    """How ignition.testmodel makes a multimodal test checkpoint of the family."""

    # (text test config, framing token -> id) -> the multimodal config.json (the family's vision config).
    config: Callable[[dict[str, Any], dict[str, int]], dict[str, Any]]
    chat: str  # the chat flavour (ignition.testmodel.CHATS) whose tokens frame images, e.g. "gemma4-vision"
    tokens: tuple[str, ...]  # the image framing tokens the flavour must carry (passed to `config` with their ids)
    processor: Mapping[str, Any]  # preprocessor_config.json of the test checkpoint


def merged_patch_processor(processor_type: str, defaults: Mapping[str, Any], **bounds: Any) -> dict[str, Any]:
    """A tiny vision checkpoint's preprocessor_config.json for a Qwen2-VL-style image processor: 14-pixel
    patches, 2 frames per temporal patch, 2 x 2 patches merged per token, bicubic resizing, the
    processor's own mean and std (`defaults`); `bounds` its fields bounding the image size."""
    fixed = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3}
    norms = {"image_mean": list(defaults["image_mean"]), "image_std": list(defaults["image_std"])}
    return {"image_processor_type": processor_type, **bounds, **fixed, **norms}


@dataclass(frozen=True, slots=True)
class TinyCheckpoint:
    """How ignition.testmodel makes a tiny random-weight checkpoint of the family."""

    config: Callable[[int], dict[str, Any]]  # vocab_size -> a tiny Hugging Face config.json dict
    hf_shapes: Callable[[Config], dict[str, tuple[int, ...]]]  # config -> Hugging Face tensor names and shapes
    # A chat flavour of ignition.testmodel.CHATS, or None for the family's own special_tokens,
    # token_roles and chat_template below (set exactly when chat is None).
    chat: str | None
    special_tokens: tuple[str, ...] = ()
    token_roles: Mapping[str, str] = field(default_factory=dict)  # "eos_token" -> token text, ...
    chat_template: str | None = None
    # (name, shape, generator) -> a tensor the generic init cannot make (gates, decays), or None for the generic one.
    init: Callable[[str, tuple[int, ...], torch.Generator], Tensor | None] | None = None
    vision: TinyVision | None = None  # None: no multimodal test checkpoint


@dataclass(frozen=True, slots=True)
class Gguf:
    """How ignition.sources reads a llama.cpp GGUF file of the family."""

    architectures: tuple[str, ...]  # general.architecture values (non-empty)
    weight_map: Mapping[str, str]  # GGUF tensor name -> Hugging Face name ("{}" for the layer)
    hf_config: Callable[[dict[str, Any], set[str]], dict[str, Any]]  # (metadata, tensor names) -> config.json dict
    tensor_fixup: Callable[[str, Tensor, dict[str, Any]], Tensor]  # (hf name, tensor, hf config) -> tensor
    end_of_turn: tuple[str, ...] = ()  # token texts that also end a turn (Gemma's <end_of_turn>)
    chat_template: str | None = None  # the published template, for conversions that drop it


# The hooks every family module defines under the same names (Family.of reads them): Family field -> name.
PLUMBING = {
    "name": "NAME",
    "hf_architectures": "HF_ARCHITECTURES",
    "hf_model_types": "HF_MODEL_TYPES",
    "config_from_hf": "config_from_hf",
    "weight_map": "WEIGHT_MAP",
    "fused": "FUSED",
    "kv_shape": "kv_shape",
    "decode_weight_bytes": "decode_weight_bytes",
    "step_program": "StepProgram",
}

# The optional hooks a family module defines under these names where the family has them (Family.of reads
# them too; a family without one leaves the name undefined): Family field -> name.
OPTIONAL = {
    "accurate_16bit": "ACCURATE_16BIT",
    "stacked": "STACKED",
    "shared_kv": "SHARED_KV",
    "extra_caches": "extra_caches",
    "state_caches": "state_caches",
    "window_pool": "window_pool",
    "ignored_tensor": "ignored_tensor",
    "canonical_tensors": "canonical_tensors",
    "duplicates": "duplicates",
    "extra_step_outputs": "extra_step_outputs",
    "extra_programs": "extra_programs",
    "host_embeddings": "host_embeddings",
}


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family: every hook ignition calls, required ones first, then the optional ones
    (None or empty: the family does not use the feature)."""

    name: str  # the registry key, the recipe's `family` and the manifest's model.family
    hf_architectures: tuple[str, ...]  # config.json "architectures" entries the family reads
    hf_model_types: tuple[str, ...]  # config.json "model_type" values the family reads
    config_from_hf: Callable[[dict[str, Any]], Config]  # config.json dict -> config; KeyError/ValueError refuse it
    # Hugging Face name -> internal name stored in the core ("{}" for the layer number; ignition.models.naming).
    weight_map: Mapping[str, str]
    # Internal tensors concatenated along rows into one, per layer: fused name -> parts (all or none present).
    fused: Mapping[str, tuple[str, ...]]
    kv_shape: Callable[[Config], tuple[int, int, int]]  # config -> (num_layers, num_kv_heads, head_dim) of the pages
    decode_weight_bytes: Callable[[Config, dict[str, Tensor]], int]  # weight bytes read per decode token
    # (config, num_top, explicit_ids, scored=...) -> the step program, forward per program_signature.
    step_program: Callable[..., torch.nn.Module]
    reference: Reference
    tiny: TinyCheckpoint
    # ---- optional
    gguf: Gguf | None = None
    # False: export defaults to float32 where the checkpoint is 16-bit (the 16-bit program is not yet accurate).
    accurate_16bit: bool = True
    # MoE expert stacks: stacked name -> its parts, per expert or already stacked (ignition.models.moe.stack_experts).
    stacked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shared_kv: bool = False  # one cache tensor per layer read as keys and values (MLA's latent cache)
    # config -> per-token caches beside the KV in some layers: (name, layers, num_heads, head_dim) each.
    extra_caches: Callable[[Config], tuple[tuple[Any, ...], ...]] | None = None
    # config -> recurrent state slots: (name, layers, per-slot shape, dtype) each (Mamba conv/SSM states).
    state_caches: Callable[[Config], tuple[tuple[Any, ...], ...]] | None = None
    # config -> (window tokens, indexes into the paged cache list, ascending) of the sliding layers' caches
    # pooled apart (helios.core.manifest.WindowPool), or None for this config.
    window_pool: Callable[[Config], tuple[int, tuple[int, ...]] | None] | None = None
    # (config, hf name) -> True for checkpoint tensors export leaves out (vision towers, MTP layers).
    ignored_tensor: Callable[[Config, str], bool] | None = None
    # (config, tensors) -> tensors: a second checkpoint layout rewritten into the names weight_map reads,
    # before anything else sees them; ValueError refuses the checkpoint.
    canonical_tensors: Callable[[Config, dict[str, Tensor]], dict[str, Tensor]] | None = None
    # config -> {internal copy name: the name it may be an exact copy of}; export keeps such a copy once.
    duplicates: Callable[[Config], dict[str, str]] | None = None
    # config -> TensorSpecs the step programs return after program_signature's (MiMo's hidden states).
    extra_step_outputs: Callable[[Config], tuple[TensorSpec, ...]] | None = None
    # (config, num_top, weights) -> program kinds beyond step/scored_prefill (ignition.models.mtp.ExtraProgram).
    extra_programs: Callable[[Config, int, dict[str, Tensor]], tuple[Any, ...]] | None = None
    vision: Vision | None = None  # the vision hooks; reference.features is set exactly when this is
    # config -> (internal weight name, image-row id or None) of each table export --host-embeddings keeps
    # out of the programs (their step takes the gathered rows: StepModule.host_input); () for this config.
    host_embeddings: Callable[[Config], tuple[tuple[str, int | None], ...]] | None = None

    @classmethod
    def of(cls, *modules: ModuleType, **fields: Any) -> Family:
        """The family whose PLUMBING hooks and OPTIONAL hooks `modules` define under their names (the
        first module holding a name wins: a family's *_config module, then its own), with every other
        field as `fields` give it (reference and tiny always; gguf and vision where the family has them).
        kv_shape and decode_weight_bytes default to ignition.models.common's (one K and one V cache per
        layer, every weight read per token); an optional hook no module defines keeps its default."""
        hooks = {"kv_shape": common.kv_shape, "decode_weight_bytes": common.decode_weight_bytes}
        for name, attribute in (PLUMBING | OPTIONAL).items():
            found = [vars(m)[attribute] for m in modules if attribute in vars(m)]
            if found:
                hooks[name] = found[0]
        missing = [PLUMBING[name] for name in PLUMBING if name not in hooks]
        if missing:
            raise TypeError(f"{modules[-1].__name__} defines no {', '.join(missing)}")
        return cls(**hooks, **fields)

    def vision_of(self, config: Config) -> Any | None:
        """The config's vision tower config, None for a text-only checkpoint or family."""
        return config.vision if self.vision is not None else None

    def images_bidirectional(self, config: Config) -> bool:
        """Whether the config's image tokens attend both ways (the step then takes attention_until)."""
        return bool(self.vision and self.vision.bidirectional and self.vision.bidirectional(config))
