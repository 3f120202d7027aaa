"""The Gemma 4 family's checkpoint side: weight-name map, the frozen config read from config.json
(text and vision), and the cache layout it implies (paged KV, sliding layers' pooled windows).

The step program, reference forward and test checkpoints are in ignition.models.gemma4."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from ignition.models import gemma4_vision
from ignition.models.common import HEAD_WEIGHT_MAP, QK_NORM_WEIGHT_MAP, QKVO_WEIGHT_MAP, SWIGLU_WEIGHT_MAP
from ignition.models.gemma3 import FULL, SANDWICH_NORM_WEIGHT_MAP, SLIDING
from ignition.models.hf_config import Fields, Key
from ignition.models.moe import STACKED_EXPERTS, expert_weight_map
from ignition.models.naming import with_prefixes


def decode_weight_bytes(config: Gemma4Config, weights: dict[str, Tensor]) -> int:
    """As common's, without the vision tower (it runs once per image, not per decode step)."""
    from ignition.models.common import decode_weight_bytes as dense

    return dense(config, {k: v for k, v in weights.items() if not k.startswith("vision.")})


NAME = "gemma4"
HF_ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
HF_MODEL_TYPES = ("gemma4_text", "gemma4")

# Like gemma3: exports default to float32 until the 16-bit program is checked on a real checkpoint.
ACCURATE_16BIT = False

_L = "model.layers.{}."
WEIGHT_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.embed_tokens_per_layer.weight": "embed_per_layer",
    "model.per_layer_model_projection.weight": "per_layer_proj",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm",
    **HEAD_WEIGHT_MAP,
    **SANDWICH_NORM_WEIGHT_MAP,
    **QKVO_WEIGHT_MAP,
    **QK_NORM_WEIGHT_MAP,
    **SWIGLU_WEIGHT_MAP,
    _L + "layer_scalar": "layers.{}.scalar",
    _L + "per_layer_input_gate.weight": "layers.{}.ple_gate",
    _L + "per_layer_projection.weight": "layers.{}.ple_proj",
    _L + "post_per_layer_input_norm.weight": "layers.{}.post_ple_norm",
    # MoE block (enable_moe_block): router, experts and their three extra norms
    _L + "router.scale": "layers.{}.router_scale",
    _L + "router.per_expert_scale": "layers.{}.expert_scale",
    _L + "post_feedforward_layernorm_1.weight": "layers.{}.post_mlp_norm_1",
    _L + "post_feedforward_layernorm_2.weight": "layers.{}.post_moe_norm",
    _L + "pre_feedforward_layernorm_2.weight": "layers.{}.moe_norm",
    **expert_weight_map(mlp=_L, router="router.proj"),
}

# Multimodal checkpoints (Gemma4ForConditionalGeneration) nest the text model under model.language_model.
WEIGHT_MAP = with_prefixes(WEIGHT_MAP, {"model.": ("model.language_model.",)}) | gemma4_vision.WEIGHT_MAP


def ignored_tensor(config: Gemma4Config, name: str) -> bool:
    """The audio tower is not compiled (no audio inputs); a vision tower without vision support neither."""
    return name.startswith(("model.audio_tower.", "model.embed_audio."))


def text_names(hf_weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """A multimodal checkpoint's text tensors under the text-only names (model.language_model. -> model.)."""
    prefix = "model.language_model."
    return {("model." + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in hf_weights.items()}


# q, k and v are not fused: k_eq_v layers have no v_proj and KV-shared layers neither k nor v.
FUSED = {"layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up")}
STACKED = STACKED_EXPERTS


@dataclass(frozen=True, slots=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # of the cache: the most over layers
    head_dim: int  # of the cache: the largest over layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_windows: tuple[int, ...]  # sliding window in tokens, 0 = full attention
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    layer_k_eq_v: tuple[bool, ...]  # values are the raw key projection (no v_proj)
    kv_sources: tuple[int, ...]  # the layer whose cache each layer attends over (itself unless shared)
    layer_intermediate: tuple[int, ...]
    # rotary per layer type: (theta, rotated angle pairs, factor) for SLIDING and FULL
    rope_sliding: tuple[float, int, float]
    rope_full: tuple[float, int, float]
    ple_dim: int  # hidden_size_per_layer_input; 0 = no per-layer inputs
    ple_vocab: int
    final_softcap: float  # 0.0 = off
    num_experts: int  # 0 = no MoE block
    top_k_experts: int
    moe_intermediate_size: int
    vision: gemma4_vision.VisionConfig | None = None  # the vision tower of a multimodal checkpoint
    # use_bidirectional_attention "vision": on sliding layers an image's tokens also see the later
    # tokens of the same image (transformers: AND(window, OR(causal, same image))); with images only.
    bidirectional_images: bool = False

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers that own a cache: the first num_layers - num_kv_shared_layers."""
        return max(self.kv_sources) + 1


def _rope(hf: dict[str, Any], kind: str, head_dim: int) -> tuple[float, int, float]:
    params = (hf.get("rope_parameters") or {}).get(kind)
    if params is None:  # transformers' defaults
        params = {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }[kind]
    rope_type = params.get("rope_type") or "default"
    theta = float(params.get("rope_theta") or 10_000.0)
    if rope_type == "default":
        return theta, head_dim // 2, 1.0
    if rope_type == "proportional":
        pairs = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        return theta, pairs, float(params.get("factor", 1.0))
    raise ValueError(
        f"rope type {rope_type!r} on {kind} layers is not supported by the {NAME} family (default and proportional are)"
    )


# The fields read as they stand in the text config (with Gemma4TextConfig's defaults).
_FIELDS = Fields(
    Gemma4Config,
    vocab_size=262_144,
    hidden_size=2304,
    rms_norm_eps=1e-6,
    max_position_embeddings=131_072,
    tie_word_embeddings=True,
    final_softcap=Key("final_logit_softcapping", 0.0, or_default=True),
)


def config_from_hf(hf: dict[str, Any]) -> Gemma4Config:
    """Read a Hugging Face gemma4_text config.json dict, or a multimodal gemma4 one (its text_config
    plus its vision_config; an audio tower is left out); unsupported variants raise ValueError."""
    if hf.get("model_type") == "gemma4" or isinstance(hf.get("text_config"), dict):
        text = dict(hf["text_config"])
        config = config_from_hf({**text, "model_type": "gemma4_text"})
        if hf.get("vision_config") is None:
            return config
        return replace(
            config,
            vision=gemma4_vision.config_from_hf(hf, text),
            bidirectional_images=text.get("use_bidirectional_attention") == "vision",
        )
    if hf.get("model_type") not in (None, *HF_MODEL_TYPES):
        raise ValueError(f"model_type {hf.get('model_type')!r} is not supported by the {NAME} family")
    # "vision": image tokens attend both ways on sliding layers (a multimodal core's bidirectional_images;
    # text-only, there are no image tokens and the mask is plainly causal, as in transformers).
    if hf.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ValueError(
            f"bidirectional attention ({hf['use_bidirectional_attention']!r}) is not supported by the "
            f'{NAME} family: only "vision" (image tokens; an incremental cache cannot attend forward '
            "over text)"
        )
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias is not supported by the {NAME} family")
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden activation {act!r} is not supported by the {NAME} family")
    n = int(hf.get("num_hidden_layers", 30))
    heads = int(hf.get("num_attention_heads", 8))
    kv_heads = int(hf.get("num_key_value_heads", 4))
    head_dim = int(hf.get("head_dim") or 256)
    window = int(hf.get("sliding_window") or 512)
    types = list(hf.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {n} layers as {SLIDING} or {FULL}, got {types!r}")
    types[-1] = FULL  # as transformers forces it
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    # Per-layer overrides of full layers: an explicit per_layer_config, else global_head_dim (default 512)
    # and, with attention_k_eq_v, num_global_key_value_heads.
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        override: dict[str, Any] = {"head_dim": int(hf.get("global_head_dim") or 512)}
        if k_eq_v and hf.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        per_layer = {i: override for i, t in enumerate(types) if t == FULL}
    per_layer = {int(k): v for k, v in per_layer.items()}
    if {k for v in per_layer.values() for k in v} - {"head_dim", "num_key_value_heads"}:
        raise ValueError(
            f"per_layer_config overrides other than head_dim/num_key_value_heads are not supported by the {NAME} family"
        )
    dims = tuple(int(per_layer.get(i, {}).get("head_dim", head_dim)) for i in range(n))
    kvs = tuple(int(per_layer.get(i, {}).get("num_key_value_heads", kv_heads)) for i in range(n))
    for t in (SLIDING, FULL):
        if len({dims[i] for i in range(n) if types[i] == t}) > 1:
            raise ValueError(f"{t} layers of different head sizes are not supported by the {NAME} family")
    max_kv = max(kvs)
    if heads % max_kv or any(max_kv % k for k in kvs):
        raise ValueError(f"kv-head counts {sorted(set(kvs))} must divide each other and the {heads} heads")
    # KV sharing: layers from first_shared on reuse the last earlier layer of their type.
    shared = int(hf.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers {shared} must be below num_hidden_layers {n}")
    sources = []
    for i, t in enumerate(types):
        if i < first_shared:
            sources.append(i)
            continue
        producers = [j for j in range(first_shared) if types[j] == t]
        if not producers:
            raise ValueError(f"KV-shared {t} layer {i} has no earlier {t} layer to read")
        sources.append(producers[-1])
    inter = int(hf.get("intermediate_size", 9216))
    double = bool(hf.get("use_double_wide_mlp", False))
    moe = bool(hf.get("enable_moe_block", False))
    ple = int(hf.get("hidden_size_per_layer_input") or 0)
    return Gemma4Config(
        **_FIELDS.read(hf),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=max_kv,
        head_dim=max(dims),
        layer_windows=tuple(window if t == SLIDING else 0 for t in types),
        layer_head_dims=dims,
        layer_kv_heads=kvs,
        layer_k_eq_v=tuple(k_eq_v and t == FULL for t in types),
        kv_sources=tuple(sources),
        layer_intermediate=tuple(inter * (2 if double and i >= first_shared else 1) for i in range(n)),
        rope_sliding=_rope(hf, SLIDING, next((d for d, t in zip(dims, types) if t == SLIDING), head_dim)),
        rope_full=_rope(hf, FULL, next(d for d, t in zip(dims, types) if t == FULL)),
        ple_dim=ple,
        ple_vocab=int(hf.get("vocab_size_per_layer_input", 262_144)) if ple else 0,
        num_experts=int(hf["num_experts"]) if moe else 0,
        top_k_experts=int(hf["top_k_experts"]) if moe else 0,
        moe_intermediate_size=int(hf["moe_intermediate_size"]) if moe else 0,
    )


def kv_shape(config: Gemma4Config) -> tuple[int, int, int]:
    """(cache-owning layers, kv heads, head size) of the paged cache; KV-shared layers own none."""
    return config.num_kv_layers, config.num_kv_heads, config.head_dim


def window_pool(config: Gemma4Config) -> tuple[int, tuple[int, ...]] | None:
    """The sliding cache-owning layers' keys and values in a second page pool (KvLayout.window_pool),
    freed behind the window by helios; KV-shared sliding layers read them there. None without any."""
    owners = [i for i in range(config.num_kv_layers) if config.layer_windows[i] > 0]
    if not owners:
        return None
    return max(config.layer_windows), tuple(index for i in owners for index in (2 * i, 2 * i + 1))
