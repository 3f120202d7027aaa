"""The glm5_next family: GLM-5.3-Flash's text model (transformers' Glm5NextForConditionalGeneration,
text model Glm5NextTextModel), hybrid KDA linear attention + k-pool DSA attention under
hyper-connection residual streams, with sigmoid-routed MoE.

What it computes, as transformers 5.24's models/glm5_next does:
- Residual: `hc_mult` streams (the embedding copied into each). Before every block (attention,
  then MLP) the streams are RMS-normed (weightless, flattened), projected into pre/post/comb
  weights, comb made doubly stochastic by `hc_sinkhorn_iters` Sinkhorn iterations; the block
  reads the pre-weighted sum of the streams, and the streams become post * block output +
  comb^T streams (DeepSeek-V4's mHC, ignition.models.common.hyper_connection, shared). The
  final head is an unweighted MEAN of the streams (V4's head is a learned sigmoid mix), then
  the final RMSNorm and lm_head.
- `layer_types`: "linear_attention" layers are Kimi Delta Attention: q, k, v projections, one
  depthwise causal conv + SiLU over [q | k | v] (flare::causal_conv1d, its window in a state
  slot), a forget gate per key channel g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(h)) +
  dt_bias)) (or -exp(A_log) * softplus(...) without a lower bound), beta = sigmoid(b_proj(h)),
  L2-normed q, k and the delta rule with per-channel decay (flare::kda, its [heads, d, d] state
  in a slot), then RMSNorm(o) * w * sigmoid(g_b(g_a(h))) and o_proj.
- "indexed_attention" layers are NoPE MLA (qk_rope_head_dim 0; the q LoRA required), absorbed
  over one latent row per token as the kimi_k3 family does (ignition.models.deepseek_v3, reused),
  attending only to the positions the k-pool indexer keeps: complete pools of `index_kpool`
  positions are scored by softmax-pooled indexer keys, the best index_topk / index_kpool pools
  are kept plus the query's own incomplete pool (flare::kpool_topk), attended by
  flare::sparse_paged_attention (glm_moe_dsa's op). A "shared" `indexer_types` layer reuses the
  previous layer's selection (transformers passes it on only from the layer right before).
- `mlp_layer_types`: "dense" SwiGLU, or "sparse": GLM's sigmoid router (selection bias, group
  limit, renormalized, scaled) over routed experts plus the shared experts; every SwiGLU (dense,
  routed and shared) clamps gate <= swiglu_limit and |up| <= swiglu_limit.
Multimodal checkpoints (a vision_config and an image token id inside the text vocabulary, see
_multimodal) export the vision tower (model.visual.*) as the vision program (glm5_next_vision.py);
the step then takes image_features / image_rows and those rows' input embeddings are the features
(transformers' masked_scatter; the model is NoPE, so image tokens need no positions). Otherwise the
tower is left out and images are refused. Always left out: the multi-token-prediction layers
(layer numbers >= num_hidden_layers, shared_head). The plain-torch reference forward is in
glm5_next_reference.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops_glm5_next  # noqa: F401  (defines flare::kda, flare::kpool_topk)
import helios.core.ops_sparse  # noqa: F401  (defines flare::sparse_paged_attention)
from ignition.models import deepseek_v3 as mla
from ignition.models import glm5_next_vision, moe, vision_hooks
from ignition.models.common import hyper_connection, hyper_residual, optional_inputs, rms_norm
from ignition.models.glm_moe_dsa import INDEXER_NORM_EPS, _indexer_types, glm_router
from ignition.models.heads import step_outputs

FAMILY = "glm5_next"
HF_ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
HF_MODEL_TYPES = ("glm5_next", "glm5_next_text")
GGUF_ARCHITECTURES: tuple[str, ...] = ()

# Exports default to float32 until the 16-bit program is checked on a real checkpoint.
ACCURATE_16BIT = False

SHARED_KV = True  # one latent row per token and layer (the KDA layers never touch theirs)
INDEXER_CACHE = "indexer_kg"  # per position of a full indexer layer: [indexer key | its gate logits]
LINEAR, INDEXED = "linear_attention", "indexed_attention"
DENSE, SPARSE = "dense", "sparse"

_TEXT_PREFIX, _FLAT_PREFIX = "model.language_model.", "model."
_L = "layers.{}."
_A = _L + "self_attn."
_I = _A + "indexer."
_TEXT_WEIGHT_MAP = {
    "embed_tokens.weight": "embed",
    "norm.weight": "norm",
    _L + "input_layernorm.weight": "layers.{}.attn_norm",
    _L + "post_attention_layernorm.weight": "layers.{}.mlp_norm",
    **{
        f"{_L}{block}_hc.{part}": f"layers.{{}}.{block}_hc.{part}"
        for block in ("attn", "ffn")
        for part in ("fn", "base", "scale")
    },
    # GLM's own hyper-connection names (transformers renames them at load)
    **{
        f"{_L}hc_{block}_{part}": f"layers.{{}}.{block}_hc.{part}"
        for block in ("attn", "ffn")
        for part in ("fn", "base", "scale")
    },
    # KDA
    _A + "q_proj.weight": "layers.{}.wq",
    _A + "k_proj.weight": "layers.{}.wk",
    _A + "v_proj.weight": "layers.{}.wv",
    _A + "conv1d.weight": "layers.{}.conv",  # [3 * qkv, 1, K]
    _A + "q_conv1d.weight": "layers.{}.conv_q",  # GLM's own per-part convs, concatenated below
    _A + "k_conv1d.weight": "layers.{}.conv_k",
    _A + "v_conv1d.weight": "layers.{}.conv_v",
    _A + "forget_gate.f_a_proj.weight": "layers.{}.f_a",
    _A + "forget_gate.f_b_proj.weight": "layers.{}.f_b",
    _A + "forget_gate.dt_bias": "layers.{}.dt_bias",
    _A + "forget_gate.A_log": "layers.{}.a_log",
    _A + "f_a_proj.weight": "layers.{}.f_a",
    _A + "f_b_proj.weight": "layers.{}.f_b",
    _A + "dt_bias": "layers.{}.dt_bias",
    _A + "A_log": "layers.{}.a_log",
    _A + "b_proj.weight": "layers.{}.w_beta",
    _A + "g_a_proj.weight": "layers.{}.g_a",
    _A + "g_b_proj.weight": "layers.{}.g_b",
    _A + "o_norm.weight": "layers.{}.o_norm",
    _A + "o_proj.weight": "layers.{}.wo",  # KDA's and MLA's output projection
    # NoPE MLA
    _A + "q_a_proj.weight": "layers.{}.wq_a",
    _A + "q_a_layernorm.weight": "layers.{}.q_a_norm",
    _A + "q_b_proj.weight": "layers.{}.wq_b",
    _A + "kv_a_proj_with_mqa.weight": "layers.{}.wkv_a",
    _A + "kv_a_layernorm.weight": "layers.{}.kv_a_norm",
    _A + "kv_b_proj.weight": "layers.{}.wkv_b",
    # k-pool indexer
    _I + "wq_b.weight": "layers.{}.idx_wq_b",
    _I + "wk.weight": "layers.{}.idx_wk",
    _I + "k_norm.weight": "layers.{}.idx_k_norm",
    _I + "k_norm.bias": "layers.{}.idx_k_norm_bias",
    _I + "weights_proj.weight": "layers.{}.idx_weights_proj",
    _I + "index_kpool_compress_ape": "layers.{}.idx_ape",
    _I + "index_kpool_compress_gate": "layers.{}.idx_gate",
    # dense MLP
    _L + "mlp.gate_proj.weight": "layers.{}.w_gate",
    _L + "mlp.up_proj.weight": "layers.{}.w_up",
    _L + "mlp.down_proj.weight": "layers.{}.w_down",
    # MoE (per-expert or stacked experts) and the shared experts
    **{k.removeprefix("model."): v for k, v in moe.expert_weight_map().items()},
    **{k.removeprefix("model."): v for k, v in moe.shared_expert_weight_map().items()},
}
# Transformers' multimodal layout (model.language_model.*) or a flat text layout (model.*).
WEIGHT_MAP = {
    **{_TEXT_PREFIX + k: v for k, v in _TEXT_WEIGHT_MAP.items()},
    **{_FLAT_PREFIX + k: v for k, v in _TEXT_WEIGHT_MAP.items()},
    "lm_head.weight": "lm_head",
    **glm5_next_vision.WEIGHT_MAP,
}
STACKED = moe.STACKED_EXPERTS
# Each layer holds only its own groups (KDA or MLA, full indexer or not, dense or MoE).
FUSED = {
    "layers.{}.w_qkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.conv": ("layers.{}.conv_q", "layers.{}.conv_k", "layers.{}.conv_v"),
    "layers.{}.idx_wk_gate": ("layers.{}.idx_wk", "layers.{}.idx_gate"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
    **moe.SHARED_EXPERT_FUSED,
}

_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
_LAYER = re.compile(r"^(?:model\.language_model\.|model\.)layers\.(\d+)\.")


def ignored_tensor(config: Glm5NextConfig, name: str) -> bool:
    """The vision tower of a text-only config and the multi-token-prediction layers (past
    num_hidden_layers, shared_head)."""
    if name.startswith(_VISION_PREFIXES):  # a stored rotary buffer is recomputed, not read
        return config.vision is None or ".rotary_pos_emb." in name
    if ".shared_head." in name:
        return True
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= config.num_layers


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class Glm5NextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: LINEAR (KDA) or INDEXED (MLA + DSA)
    mlp_layer_types: tuple[str, ...]  # per layer: DENSE or SPARSE
    indexer_types: tuple[str, ...]  # per layer: "full" runs the indexer, "shared" reuses the previous layer's
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # NoPE MLA (names as ignition.models.deepseek_v3's config, whose absorbed attention is reused)
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # k-pool indexer
    index_topk: int  # positions kept per query by the pools (index_topk / index_kpool pools)
    index_n_heads: int
    index_head_dim: int
    index_kpool: int
    index_tail: bool  # index_kpool_always_select_tail
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel_size: int
    linear_lower_bound: float | None  # None: -exp(A_log) * softplus gate
    # hyper-connections
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # MLPs
    intermediate_size: int
    moe_intermediate_size: int
    n_shared_experts: int
    activation: moe.ExpertActivation  # SwiGLU clamped at swiglu_limit (dense, routed and shared)
    router: moe.RouterSpec

    qk_rope_head_dim: int = 0  # NoPE (refused otherwise)
    vision: glm5_next_vision.VisionConfig | None = None  # the vision tower of a multimodal checkpoint

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Indexed layers with their own indexer, in order (one indexer cache tensor each)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED and self.indexer_types[i] == "full")

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"{field} {value!r} is not supported by the {FAMILY} family: {why}")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: nested under text_config, or (flat checkpoints) the top level."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def _tied(hf: dict[str, Any], text: dict[str, Any]) -> bool:
    top, inner = hf.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if text is not hf and top is not None and inner is not None and bool(top) != bool(inner):
        _refuse(
            "text_config.tie_word_embeddings", inner, f"it disagrees with the top-level tie_word_embeddings {top!r}"
        )
    return bool(top if top is not None else inner)


def _check_supported(text: dict[str, Any]) -> None:
    if text.get("attention_bias"):
        _refuse("attention_bias", text["attention_bias"], "the projections have no bias")
    if text.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", text["hidden_act"], "only silu (MLPs and the KDA conv) is implemented")
    if text.get("quantization_config"):
        _refuse(
            "quantization_config", text["quantization_config"].get("quant_method"), "quantized checkpoints are not read"
        )
    if int(text.get("qk_rope_head_dim") or 0) != 0:
        _refuse("qk_rope_head_dim", text["qk_rope_head_dim"], "GLM-5.3-Flash's DSA layers are NoPE (0)")
    if text.get("q_lora_rank", 1536) is None:
        _refuse("q_lora_rank", None, "the indexer reads the q LoRA")
    heads = int(text.get("num_attention_heads", 64))
    if int(text.get("num_key_value_heads") or heads) != heads:
        _refuse("num_key_value_heads", text["num_key_value_heads"], f"it must equal num_attention_heads {heads}")


def _schedules(text: dict[str, Any], layers: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(layer_types, mlp_layer_types, indexer_types) as Glm5NextTextConfig.__post_init__ derives them."""
    kinds = text.get("layer_types") or [LINEAR if i % 4 != 3 else INDEXED for i in range(layers)]
    kinds = tuple(INDEXED if k == "full_attention" else k for k in kinds)
    if len(kinds) != layers or set(kinds) - {LINEAR, INDEXED}:
        _refuse("layer_types", list(kinds), f"it must name {layers} layers as {LINEAR} or {INDEXED}")
    mlps = tuple(text.get("mlp_layer_types") or [DENSE] * min(3, layers) + [SPARSE] * (layers - min(3, layers)))
    if len(mlps) != layers or set(mlps) - {DENSE, SPARSE}:
        _refuse("mlp_layer_types", list(mlps), f"it must name {layers} layers as {DENSE} or {SPARSE}")
    indexers = _indexer_types(text, layers)
    if len(indexers) != layers or set(indexers) - {"full", "shared"}:
        _refuse("indexer_types", list(indexers), f"it must name 'full' or 'shared' for each of the {layers} layers")
    for i, kind in enumerate(kinds):
        # transformers hands a layer's selection only to the very next layer (Glm5NextTextAttention.next_skip_topk)
        if (
            kind == INDEXED
            and indexers[i] == "shared"
            and (i == 0 or kinds[i - 1] != INDEXED or indexers[i - 1] != "full")
        ):
            _refuse("indexer_types", list(indexers), f"shared layer {i} must follow a full indexed_attention layer")
    return kinds, mlps, indexers


def _linear_fields(text: dict[str, Any]) -> dict[str, Any]:
    """KDA sizes, from the flat fields or (GLM's own configs) linear_attn_config, as transformers reads them."""
    fields = {
        "linear_head_dim": int(text.get("linear_head_dim", 128)),
        "linear_num_heads": int(text.get("linear_num_heads", 64)),
        "conv_kernel_size": int(text.get("linear_conv_kernel_dim", 4)),
        "linear_lower_bound": text.get("linear_lower_bound", -5.0),
    }
    nested = text.get("linear_attn_config")
    if isinstance(nested, dict):
        fields["linear_head_dim"] = int(nested.get("head_dim", fields["linear_head_dim"]))
        fields["linear_num_heads"] = int(nested.get("num_heads", fields["linear_num_heads"]))
        fields["conv_kernel_size"] = int(nested.get("short_conv_kernel_size", fields["conv_kernel_size"]))
        fields["linear_lower_bound"] = nested.get("gate_lower_bound", fields["linear_lower_bound"])
        if nested.get("safe_gate", True) and fields["linear_lower_bound"] is None:
            fields["linear_lower_bound"] = -5.0
    if fields["linear_lower_bound"] is not None:
        fields["linear_lower_bound"] = float(fields["linear_lower_bound"])
    if fields["conv_kernel_size"] < 2:
        _refuse("linear_conv_kernel_dim", fields["conv_kernel_size"], "the short conv needs a kernel of at least 2")
    return fields


def config_from_hf(hf: dict[str, Any]) -> Glm5NextConfig:
    """Read a Hugging Face config.json dict (text_config nested or flat); unsupported variants raise
    ValueError naming the field."""
    text = text_config(hf)
    tied = _tied(hf, text)
    _check_supported(text)
    layers = int(text.get("num_hidden_layers", 45))
    kinds, mlps, indexers = _schedules(text, layers)
    kpool, topk = int(text.get("index_kpool", 16)), int(text.get("index_topk", 2048))
    if kpool < 1:
        _refuse("index_kpool", kpool, "it must be positive")
    if topk < kpool or topk % kpool:
        _refuse("index_topk", topk, f"it must be a positive multiple of index_kpool {kpool}")
    if not text.get("index_kpool_always_select_tail", True) and kpool > 1:
        # Without the tail a query before its first complete pool keeps no position; transformers then
        # softmaxes over an all-masked row (every position, future ones too, at equal weight).
        _refuse("index_kpool_always_select_tail", False, "the first index_kpool - 1 positions would attend to nothing")
    limit = float(text.get("swiglu_limit", 10.0) or 0.0)
    if limit <= 0:
        _refuse("swiglu_limit", limit, "the SwiGLU clamp must be positive")
    router = glm_router(text, default_experts=288)
    return Glm5NextConfig(
        vocab_size=int(text.get("vocab_size", 154880)),
        hidden_size=int(text.get("hidden_size", 4096)),
        num_layers=layers,
        layer_types=kinds,
        mlp_layer_types=mlps,
        indexer_types=indexers,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(text.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=tied,
        num_heads=int(text.get("num_attention_heads", 64)),
        q_lora_rank=int(text.get("q_lora_rank", 1536)),
        kv_lora_rank=int(text.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(text.get("qk_nope_head_dim", 256)),
        v_head_dim=int(text.get("v_head_dim", 256)),
        index_topk=topk,
        index_n_heads=int(text.get("index_n_heads", 32)),
        index_head_dim=int(text.get("index_head_dim", 128)),
        index_kpool=kpool,
        index_tail=bool(text.get("index_kpool_always_select_tail", True)),
        **_linear_fields(text),
        hc_mult=int(text.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(text.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(text.get("hc_eps", 1e-6)),
        intermediate_size=int(text.get("intermediate_size", 12288)),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 2048)),
        n_shared_experts=int(text.get("n_shared_experts", 1) or 0),
        activation=moe.ExpertActivation("silu", limit=limit),
        router=router,
        vision=glm5_next_vision.config_from_hf(hf, text) if _multimodal(hf, text) else None,
    )


def _multimodal(hf: dict[str, Any], text: dict[str, Any]) -> bool:
    """A vision tower to compile: a vision_config and an image token id (image_token_id, else
    Glm5NextConfig's default) inside the text vocabulary."""
    if not isinstance(hf.get("vision_config"), dict):
        return False
    return 0 <= glm5_next_vision.image_token_id(hf) < int(text.get("vocab_size", 154880))


def kv_shape(config: Glm5NextConfig) -> tuple[int, int, int]:
    """(num_layers, 1, kv_lora_rank): one NoPE latent row per token (SHARED_KV); KDA layers leave theirs unused."""
    return config.num_layers, 1, config.kv_lora_rank


def extra_caches(config: Glm5NextConfig) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """Per position of each full indexer layer: its indexer key and gate logits [2 * index_head_dim]."""
    return ((INDEXER_CACHE, config.indexer_layers, 1, 2 * config.index_head_dim),)


def state_caches(config: Glm5NextConfig) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...], str], ...]:
    """Per-sequence state of the KDA layers: the conv's last K - 1 inputs and the delta-rule state."""
    c, layers = config, config.linear_layers
    return (
        ("conv", layers, (c.conv_dim, c.conv_kernel_size - 1), "float32"),
        ("recurrent", layers, (c.linear_num_heads, c.linear_head_dim, c.linear_head_dim), "float32"),
    )


def decode_weight_bytes(config: Glm5NextConfig, weights: dict[str, Tensor]) -> int:
    text = {k: v for k, v in weights.items() if not k.startswith("vision.")}  # the tower runs per image, not per step
    return moe.decode_weight_bytes(config, text, config.router.top_k)


# ---------------------------------------------------------------------------- step program


class StepProgram(mla.StepProgram):
    """forward(weights, kv_cache, *inputs) per helios.core.program.program_signature, with state:
    kv_cache = [latent_0, ..., latent_{L-1}] ([pages, page_tokens, 1, kv_lora_rank]), the indexer
    caches of the full indexer layers ([pages, page_tokens, 1, 2 * index_head_dim]), then the conv
    states of the KDA layers and their delta-rule states. kimi_k3's absorbed-MLA helpers (query,
    latent_output) are inherited."""

    config: Glm5NextConfig

    def forward(
        self,
        weights,
        kv_cache,
        token_ids,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
        state_slots,
        extra_1=None,
        extra_2=None,
        extra_3=None,
        extra_4=None,
    ):
        """Vision cores take image_features [I, hidden] and image_rows [I] last (program_signature):
        those rows' input embeddings are the features; rows of -1 are unused."""
        extra = [t for t in (extra_1, extra_2, extra_3, extra_4) if t is not None]
        image = (extra.pop(-2), extra.pop(-1)) if self.config.vision is not None else None
        logprob_ids, target_ids = optional_inputs(*(extra + [None, None])[:2], self.explicit_ids, self.scored)
        c = self.config
        wdt = weights["embed"].dtype
        n_index, n_linear = len(c.indexer_layers), len(c.linear_layers)
        index_caches = dict(zip(c.indexer_layers, kv_cache[c.num_layers : c.num_layers + n_index], strict=True))
        states = kv_cache[c.num_layers + n_index :]  # conv states, then delta-rule states, of the KDA layers
        linear = {layer: j for j, layer in enumerate(c.linear_layers)}
        paged = (slot_mapping, block_tables, seq_lens, query_start_loc, positions)
        steps = (state_slots, query_start_loc, positions)
        # The hc_mult residual streams, norms and mixing stay fp32; matmuls run in the core dtype.
        x = F.embedding(token_ids, weights["embed"]).float()
        if image is not None:
            features, rows = image
            T = x.shape[0]
            rows = torch.where(rows < 0, T, rows)  # unused rows land on a scratch row past the end
            x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_copy(0, rows, features.float())[:T]
        streams = x[:, None, :].expand(-1, c.hc_mult, -1)
        selected: Tensor | None = None  # [T, width] kept positions of the last full indexer layer
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            post, comb, collapsed = self.hyper(weights, p + "attn_hc.", streams)
            h = rms_norm(collapsed, weights[p + "attn_norm"], c.rms_norm_eps).to(wdt)
            if kind == LINEAR:
                j = linear[i]
                out = self.kda(weights, i, h, states[j], states[n_linear + j], steps)
            else:
                q_resid = self.q_resid(weights, i, h)
                if i in index_caches:
                    selected = self.indexer(weights, i, h, q_resid, index_caches[i], paged)
                assert selected is not None  # a shared layer follows a full one (config_from_hf)
                out = self.sparse_mla(weights, i, h, q_resid, kv_cache[i], selected, paged)
            streams = hyper_residual(post, comb, out, streams)
            post, comb, collapsed = self.hyper(weights, p + "ffn_hc.", streams)
            h = rms_norm(collapsed, weights[p + "mlp_norm"], c.rms_norm_eps).to(wdt)
            streams = hyper_residual(post, comb, self.mlp(weights, i, h), streams)
        x = rms_norm(streams.mean(dim=1), weights["norm"], c.rms_norm_eps).to(wdt)  # the hyper head: a plain mean
        return step_outputs(x, weights, c.tie_word_embeddings, logits_indices, self.num_top, logprob_ids, target_ids)

    def hyper(self, weights: dict[str, Tensor], prefix: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        return hyper_connection(
            streams,
            weights[prefix + "fn"],
            weights[prefix + "base"],
            weights[prefix + "scale"],
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
        )

    def kda(
        self,
        weights: dict[str, Tensor],
        i: int,
        h: Tensor,
        conv_state: Tensor,
        recurrent_state: Tensor,
        steps: tuple[Tensor, Tensor, Tensor],
    ) -> Tensor:
        """A Kimi Delta Attention layer over its two state slots: h [T, hidden] -> [T, hidden] fp32."""
        c, p = self.config, f"layers.{i}."
        heads, dim = c.linear_num_heads, c.linear_head_dim
        mixed = F.linear(h, weights[p + "w_qkv"])
        conv_weight = weights[p + "conv"].reshape(c.conv_dim, c.conv_kernel_size)
        mixed = torch.ops.flare.causal_conv1d(
            mixed, conv_weight, conv_weight.new_zeros(c.conv_dim), conv_state, *steps, True
        )
        q, k, v = mixed.float().view(-1, 3, heads, dim).unbind(1)
        gate = F.linear(F.linear(h, weights[p + "f_a"]), weights[p + "f_b"]).float() + weights[p + "dt_bias"].float()
        rate = weights[p + "a_log"].float().exp()[:, None]  # [heads, 1]
        gate = gate.view(-1, heads, dim)
        if c.linear_lower_bound is not None:
            g = c.linear_lower_bound * torch.sigmoid(rate * gate)
        else:
            g = -rate * F.softplus(gate)
        beta = torch.sigmoid(F.linear(h, weights[p + "w_beta"]).float())
        out = torch.ops.flare.kda(q, k, v, g, beta, recurrent_state, *steps, dim**-0.5, True)
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weights[p + "o_norm"].float()
        out = out * torch.sigmoid(
            F.linear(F.linear(h, weights[p + "g_a"]), weights[p + "g_b"]).float().view(-1, heads, dim)
        )
        return F.linear(out.reshape(-1, c.qkv_dim).to(h.dtype), weights[p + "wo"]).float()

    def indexer(
        self, weights: dict[str, Tensor], i: int, h: Tensor, q_resid: Tensor, cache: Tensor, paged: tuple[Tensor, ...]
    ) -> Tensor:
        """Write this step's indexer rows and select each query's positions: [T, width] int64."""
        c, p = self.config, f"layers.{i}."
        slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
        heads, dim = c.index_n_heads, c.index_head_dim
        q = F.linear(q_resid, weights[p + "idx_wq_b"]).float().view(-1, heads, dim)
        k, gate = F.linear(h, weights[p + "idx_wk_gate"]).float().split([dim, dim], dim=-1)
        k = F.layer_norm(
            k, (dim,), weights[p + "idx_k_norm"].float(), weights[p + "idx_k_norm_bias"].float(), INDEXER_NORM_EPS
        )
        row = torch.cat([k, gate], dim=-1)[:, None, :].to(cache.dtype)
        torch.ops.flare.write_kv(cache, cache, row, row, slot_mapping)
        head_weights = F.linear(h.float(), weights[p + "idx_weights_proj"].float()) * heads**-0.5
        return torch.ops.flare.kpool_topk(
            q,
            head_weights,
            cache,
            weights[p + "idx_ape"].float(),
            block_tables,
            seq_lens,
            query_start_loc,
            positions,
            dim**-0.5,
            c.index_kpool,
            c.index_topk // c.index_kpool,
            c.index_tail,
        )

    def q_resid(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        """The normed q LoRA down-projection [T, q_lora_rank] in h's dtype (q_a_layernorm: rms_norm_eps)."""
        p = f"layers.{layer}."
        q_a = rms_norm(F.linear(h, weights[p + "wq_a"]).float(), weights[p + "q_a_norm"], self.config.rms_norm_eps)
        return q_a.to(h.dtype)

    def sparse_mla(
        self,
        weights: dict[str, Tensor],
        i: int,
        h: Tensor,
        q_resid: Tensor,
        cache: Tensor,
        selected: Tensor,
        paged: tuple[Tensor, ...],
    ) -> Tensor:
        """NoPE absorbed MLA over the selected latent rows: h [T, hidden] -> [T, hidden] fp32."""
        c, p = self.config, f"layers.{i}."
        slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
        q_nope = self.query(weights, i, h, q_resid)  # [T, H, nope]
        latent = rms_norm(F.linear(h, weights[p + "wkv_a"]).float(), weights[p + "kv_a_norm"], c.rms_norm_eps)
        latent = latent[:, None, :].to(cache.dtype)
        torch.ops.flare.write_kv(cache, cache, latent, latent, slot_mapping)
        # q_nope . (W_UK c_kv) == (q_nope W_UK) . c_kv: the keys never leave the latent space.
        w_uk = self._w_kv_b(weights, i)[:, : c.qk_nope_head_dim]
        query = torch.bmm(q_nope.transpose(0, 1).to(h.dtype), w_uk).float().transpose(0, 1).to(cache.dtype)
        attn = torch.ops.flare.sparse_paged_attention(
            query, cache, cache, block_tables, seq_lens, query_start_loc, positions, selected, c.softmax_scale
        )
        return self.latent_output(weights, i, attn, h.dtype)

    def mlp(self, weights: dict[str, Tensor], i: int, h: Tensor) -> Tensor:
        c = self.config
        if c.is_moe(i):
            return moe.sparse_moe(c.router, weights, i, h, c.activation, shared=c.n_shared_experts > 0)
        return moe.shared_mlp(h, weights[f"layers.{i}.w_gate_up"], weights[f"layers.{i}.w_down"], c.activation)


def reference_logits(
    config: Glm5NextConfig,
    hf_weights: dict[str, Tensor],
    token_ids: list[int],
    image_features: Tensor | None = None,
    image_positions: list[int] | None = None,
) -> Tensor:
    """The independent plain-torch forward (ignition.models.glm5_next_reference); row i of
    image_features replaces the input embedding at image_positions[i]."""
    from ignition.models.glm5_next_reference import reference_logits as forward

    return forward(config, hf_weights, token_ids, image_features, image_positions)


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry GLM-5.3-Flash's special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "glm53"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny flat GLM-5.3-Flash config: KDA, full indexer, shared indexer, KDA layers (the first MLP
    dense); pools of 4 keeping 2 (+ the tail) so 20+-token prompts drop positions; 16 indexer heads
    (zero-score ties rarer); 8 experts top-2 with a shared expert; 4 hyper-connection streams; a
    SwiGLU clamp of 1 the activations reach; a one-block vision tower export leaves out."""
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, INDEXED, INDEXED, LINEAR],
        "indexer_types": ["full", "full", "shared", "full"],
        "mlp_layer_types": [DENSE, SPARSE, SPARSE, SPARSE],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 0,
        "v_head_dim": 16,
        "index_topk": 8,
        "index_kpool": 4,
        "index_kpool_always_select_tail": True,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 1.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vision_config": dict(TEST_VISION),
    }


# A one-block vision tower (transformers builds it with the model; export leaves its tensors out).
TEST_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "projection_intermediate_size": 64,
    "patch_size": 2,
    "spatial_merge_size": 1,
    "temporal_patch_size": 1,
    "image_size": 8,
}


def testmodel_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Tensor | None:
    """Slow KDA decays (-5 sigmoid(A (f + dt_bias)) mostly -0.01 to -0.3: the state spans chunks), fan-in-scaled conv,
    stacked experts and hyper-connection projections, hyper scales near one; the vision tower's patch
    embedding and downsample scaled by their whole fan-in, its biases small."""
    if name.startswith("model.visual.") and len(shape) > 2:  # Conv3d / Conv2d kernels
        return torch.randn(shape, generator=generator) / math.prod(shape[1:]) ** 0.5
    if name.startswith("model.visual.") and name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=generator)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 4.0, generator=generator).log()
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=generator) - 3.0
    if name.endswith("conv1d.weight"):  # [C, 1, K]
        return torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, out, in]
        return torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    if name.endswith(("_hc.fn",)):
        return 0.5 * torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    if name.endswith(("_hc.base", "index_kpool_compress_ape", "e_score_correction_bias")):
        return 0.3 * torch.randn(shape, generator=generator)
    if name.endswith("_hc.scale"):
        return 1.0 + 0.2 * torch.randn(shape, generator=generator)
    if name.endswith("k_norm.bias"):
        return 0.1 * torch.randn(shape, generator=generator)
    return None


def hf_shapes(c: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    """Glm5NextForConditionalGeneration tensor names and shapes (text under model.language_model.,
    stacked experts as transformers 5 saves them) plus, text-only, one vision tensor export ignores,
    or a multimodal config's whole vision tower."""
    h, t = c.hidden_size, _TEXT_PREFIX
    hc_mixes = (2 + c.hc_mult) * c.hc_mult
    visual = (
        glm5_next_vision.hf_shapes(c.vision)
        if c.vision is not None
        else {"model.visual.post_layernorm.weight": (TEST_VISION["hidden_size"],)}
    )
    shapes: dict[str, tuple[int, ...]] = {
        t + "embed_tokens.weight": (c.vocab_size, h),
        t + "norm.weight": (h,),
        **visual,
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i, kind in enumerate(c.layer_types):
        layer: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        for block in ("attn_hc.", "ffn_hc."):
            layer |= {block + "fn": (hc_mixes, c.hc_mult * h), block + "base": (hc_mixes,), block + "scale": (3,)}
        a = "self_attn."
        if kind == LINEAR:
            qkv, d = c.qkv_dim, c.linear_head_dim
            layer |= {
                a + "q_proj.weight": (qkv, h),
                a + "k_proj.weight": (qkv, h),
                a + "v_proj.weight": (qkv, h),
                a + "conv1d.weight": (c.conv_dim, 1, c.conv_kernel_size),
                a + "forget_gate.f_a_proj.weight": (d, h),
                a + "forget_gate.f_b_proj.weight": (qkv, d),
                a + "forget_gate.dt_bias": (qkv,),
                a + "forget_gate.A_log": (c.linear_num_heads,),
                a + "b_proj.weight": (c.linear_num_heads, h),
                a + "g_a_proj.weight": (d, h),
                a + "g_b_proj.weight": (qkv, d),
                a + "o_norm.weight": (d,),
                a + "o_proj.weight": (h, qkv),
            }
        else:
            heads = c.num_heads
            layer |= {
                a + "q_a_proj.weight": (c.q_lora_rank, h),
                a + "q_a_layernorm.weight": (c.q_lora_rank,),
                a + "q_b_proj.weight": (heads * c.qk_head_dim, c.q_lora_rank),
                a + "kv_a_proj_with_mqa.weight": (c.kv_lora_rank, h),
                a + "kv_a_layernorm.weight": (c.kv_lora_rank,),
                a + "kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                a + "o_proj.weight": (h, heads * c.v_head_dim),
            }
            if c.indexer_types[i] == "full":
                x, dim = a + "indexer.", c.index_head_dim
                layer |= {
                    x + "wq_b.weight": (c.index_n_heads * dim, c.q_lora_rank),
                    x + "wk.weight": (dim, h),
                    x + "k_norm.weight": (dim,),
                    x + "k_norm.bias": (dim,),
                    x + "weights_proj.weight": (c.index_n_heads, h),
                    x + "index_kpool_compress_ape": (c.index_kpool, dim),
                    x + "index_kpool_compress_gate": (dim, h),
                }
        if c.is_moe(i):
            e, f, s = c.router.num_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
            layer |= {
                "mlp.gate.weight": (e, h),
                "mlp.gate.e_score_correction_bias": (e,),
                "mlp.experts.gate_up_proj": (e, 2 * f, h),
                "mlp.experts.down_proj": (e, h, f),
            }
            if s:
                layer |= {
                    "mlp.shared_experts.gate_proj.weight": (s, h),
                    "mlp.shared_experts.up_proj.weight": (s, h),
                    "mlp.shared_experts.down_proj.weight": (h, s),
                }
        else:
            f = c.intermediate_size
            layer |= {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
        shapes.update({f"{t}layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


# Test vision checkpoints: the "glm53" chat flavour plus GLM's image and video framing tokens.
TEST_VISION_CHAT = "glm53-vision"
TESTMODEL_VISION_TOKENS = (
    glm5_next_vision.IMAGE_TOKEN,
    glm5_next_vision.START_TOKEN,
    glm5_next_vision.END_TOKEN,
    "<|video|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)


def testmodel_vision(text: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """A tiny multimodal Glm5NextConfig around testmodel_config's text model (nested as text_config):
    a 2-block vision tower of width 32 (2 heads of 16) over 14-pixel patches of 2 frames, 2 x 2
    merging into the text width, a merger SwiGLU of 48, clamps of 1. `tokens`:
    TESTMODEL_VISION_TOKENS -> ids."""
    inner = {k: v for k, v in text.items() if k not in ("architectures", "vision_config")}
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": inner | {"model_type": "glm5_next_text"},
        "vision_config": {
            "model_type": "glm5_next_vision",
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 64,
            "out_hidden_size": text["hidden_size"],
            "projection_intermediate_size": 48,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "hidden_act": "silu",
            "attention_bias": True,
            "rms_norm_eps": 1e-5,
            "swiglu_limit": 1.0,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        },
        "image_token_id": tokens[glm5_next_vision.IMAGE_TOKEN],
        "image_start_token_id": tokens[glm5_next_vision.START_TOKEN],
        "image_end_token_id": tokens[glm5_next_vision.END_TOKEN],
        "video_token_id": tokens["<|video|>"],
        "video_start_token_id": tokens["<|begin_of_video|>"],
        "video_end_token_id": tokens["<|end_of_video|>"],
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "max_position_embeddings": text["max_position_embeddings"],  # also at the top, where testmodel reads it
    }


# Glm5NextImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json): 4 .. 64
# tokens of 28 x 28 pixels per image.
TESTMODEL_PROCESSOR = {
    "image_processor_type": "Glm5NextImageProcessor",
    "min_image_tokens": 4,
    "max_image_tokens": 64,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "resample": 3,
    "image_mean": list(glm5_next_vision.PROCESSOR_DEFAULTS["image_mean"]),
    "image_std": list(glm5_next_vision.PROCESSOR_DEFAULTS["image_std"]),
}


# ------------------------------------------------------------------------- vision hooks (ignition.export)


vision_program, vision_examples, reference_features, vision_profile = vision_hooks.of(glm5_next_vision)
