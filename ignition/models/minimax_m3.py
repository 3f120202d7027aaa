"""The minimax_m3 family: MiniMax M3 text (transformers' MiniMaxM3VLForCausalLM / the text model
of MiniMaxM3SparseForConditionalGeneration).

GQA attention with per-head Gemma-style q/k norms (x * (1 + w)) and partial rotary (the first
head_dim * partial_rotary_factor channels, halves layout). Layers named `minimax_m3_sparse` in
`layer_types` are block-sparse: a Lightning indexer (its own q/k projections, norms and
rotary; one key per token kept in an extra paged cache, KvLayout.extra) picks, per indexer
head, the best `index_topk_blocks` blocks of `index_block_size` keys (the local ones always
among them), and the attention sees only those blocks (helios.core.ops_block_sparse). MLPs
per `mlp_layer_types`: dense SwiGLU-OAI (clamped, alpha-gated, up + 1), or a sigmoid-routed
MoE with a score-correction bias, renormalized weights times routed_scaling_factor, and an
always-on shared expert of the same activation. Checked against transformers 5.24.

Multimodal checkpoints (MiniMaxM3SparseForConditionalGeneration: a vision_config beside the
text_config and an image token id inside the vocabulary, see _multimodal) export a vision program
(minimax_m3_vision.py); the step then takes image_features / image_rows and those rows' input
embeddings are the features (transformers' masked_scatter; image tokens keep plain 1-D positions).
A text-only config refuses vision tensors.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import minimax_m3_vision, moe, vision_hooks
from ignition.models.common import (
    ATTENTION_WEIGHT_MAP,
    DecoderFields,
    attention_shapes,
    offset_norm,
    partial_rotary,
    qk_norm_shapes,
    theta_powers,
)
from ignition.models.family import Family, PromptImages, Reference, TinyCheckpoint, TinyVision, merged_patch_processor
from ignition.models.hf_config import REQUIRED, AttentionHeads, Fields
from ignition.models.naming import refuse_vision_tensors, with_prefixes, without_prefixes
from ignition.models.step import Paged, StepInputs, StepModule, embed_images
from ignition.models.vision_common import nested_testmodel

NAME = "minimax_m3"
HF_ARCHITECTURES = ("MiniMaxM3VLForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
HF_MODEL_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")

SPARSE, FULL = "minimax_m3_sparse", "full_attention"
DEFAULT_THETA = 5000000.0  # MiniMaxM3VLTextConfig.default_theta

# transformers' MiniMaxM3VLForCausalLM names -> internal names.
_TEXT_WEIGHT_MAP = {
    **ATTENTION_WEIGHT_MAP,
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.q_norm",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.k_norm",
    "model.layers.{}.self_attn.indexer.q_proj.weight": "layers.{}.idx_wq",
    "model.layers.{}.self_attn.indexer.k_proj.weight": "layers.{}.idx_wk",
    "model.layers.{}.self_attn.indexer.q_norm.weight": "layers.{}.idx_q_norm",
    "model.layers.{}.self_attn.indexer.k_norm.weight": "layers.{}.idx_k_norm",
    "model.layers.{}.mlp.gate_up_proj.weight": "layers.{}.w_gate_up",  # dense layers
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.w_down",
    "model.layers.{}.mlp.shared_experts.gate_up_proj.weight": "layers.{}.w_shared_gate_up",
    "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.w_shared_down",
    **moe.expert_weight_map(),
    # MiniMax's own layout (what transformers' conversion_mapping "minimax_m3_vl" renames).
    "model.layers.{}.self_attn.index_q_proj.weight": "layers.{}.idx_wq",
    "model.layers.{}.self_attn.index_k_proj.weight": "layers.{}.idx_wk",
    "model.layers.{}.self_attn.index_q_norm.weight": "layers.{}.idx_q_norm",
    "model.layers.{}.self_attn.index_k_norm.weight": "layers.{}.idx_k_norm",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.w_gate",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.w_up",
    "model.layers.{}.block_sparse_moe.e_score_correction_bias": "layers.{}.router_bias",
    **moe.expert_weight_map("model.layers.{}.block_sparse_moe.", gate="w1", up="w3", down="w2"),
    **moe.shared_expert_weight_map("model.layers.{}.block_sparse_moe."),
}

# Where multimodal checkpoints keep the text model: transformers' MiniMaxM3SparseForConditionalGeneration
# and MiniMax's own layout. Vision-tower and projector tensors are refused by name.
_TEXT_PREFIXES = {
    "model.": ("model.language_model.", "language_model.model."),
    "lm_head.": ("language_model.lm_head.",),
}


WEIGHT_MAP = with_prefixes(_TEXT_WEIGHT_MAP, _TEXT_PREFIXES) | minimax_m3_vision.WEIGHT_MAP
STACKED = moe.STACKED_EXPERTS
# A dense layer stored as gate_proj/up_proj, a shared expert stored the same way; groups absent
# from a layer (transformers' fused layout, the other kind of layer) are skipped.
FUSED = {"layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"), **moe.SHARED_EXPERT_FUSED}


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class MiniMaxM3Config(DecoderFields):
    rotary_dim: int  # head_dim * partial_rotary_factor channels rotated, the rest passed through
    sparse_layers: tuple[bool, ...]  # per layer: block-sparse attention through the indexer
    moe_layers: tuple[bool, ...]  # per layer: routed MoE (else a dense MLP)
    dense_intermediate_size: int
    intermediate_size: int  # each routed expert's width
    shared_intermediate_size: int
    router: moe.RouterSpec
    activation: moe.ExpertActivation  # clamped_glu (SwiGLU-OAI) everywhere: dense, shared and routed
    index_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    vision: minimax_m3_vision.VisionConfig | None = None  # the vision tower of a multimodal checkpoint

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if sparse)


def _text(hf: dict[str, Any]) -> dict[str, Any]:
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def _refuse(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{field} = {value!r} is not supported by the {NAME} family: {why}")


def _layer_kinds(hf: dict[str, Any], layers: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(sparse attention, MoE) per layer, from layer_types / mlp_layer_types or the legacy
    sparse_attention_config.sparse_attention_freq / moe_layer_freq (as the config class reads them)."""
    sparse_cfg = hf.get("sparse_attention_config") or {}
    kinds = hf.get("layer_types")
    if kinds is None and "sparse_attention_freq" in sparse_cfg:
        kinds = [SPARSE if f else FULL for f in sparse_cfg["sparse_attention_freq"]]
    kinds = list(kinds) if kinds is not None else [FULL] * layers
    mlps = hf.get("mlp_layer_types")
    if mlps is None and hf.get("moe_layer_freq") is not None:
        mlps = ["sparse" if f else "dense" for f in hf["moe_layer_freq"]]
    mlps = list(mlps) if mlps is not None else ["sparse"] * layers
    if len(kinds) != layers or any(k not in (SPARSE, FULL) for k in kinds):
        raise _refuse("layer_types", kinds, f"one of {FULL!r} / {SPARSE!r} per layer is")
    if len(mlps) != layers or any(k not in ("sparse", "dense") for k in mlps):
        raise _refuse("mlp_layer_types", mlps, "one of 'sparse' / 'dense' per layer is")
    return tuple(k == SPARSE for k in kinds), tuple(k == "sparse" for k in mlps)


def _index_field(hf: dict[str, Any], flat: str, legacy: str, default: int) -> int:
    """An indexer setting: the legacy sparse_attention_config key wins, as in the config class."""
    sparse_cfg = hf.get("sparse_attention_config") or {}
    return int(sparse_cfg[legacy] if legacy in sparse_cfg else hf.get(flat, default))


def _rotary(hf: dict[str, Any], head_dim: int) -> tuple[int, float]:
    params = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise _refuse("rope_parameters.rope_type", kind, "only the default rotary is implemented")
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    dim = int(head_dim * factor)
    # transformers rotates head_dim * partial_rotary_factor channels and never reads rotary_dim;
    # a checkpoint whose rotary_dim says otherwise would be served differently from its reference.
    if "rotary_dim" in hf and int(hf["rotary_dim"]) != dim:
        raise _refuse("rotary_dim", hf["rotary_dim"], f"transformers rotates head_dim * partial_rotary_factor = {dim}")
    if dim < 2 or dim % 2:
        raise _refuse("partial_rotary_factor", factor, "the rotated width must be a positive even number")
    return dim, float(params.get("rope_theta") or hf.get("rope_theta") or DEFAULT_THETA)


# The fields read as they stand in the text config; MiniMaxM3VLTextConfig's defaults for the optional ones.
_FIELDS = Fields(
    MiniMaxM3Config,
    vocab_size=REQUIRED,
    hidden_size=REQUIRED,
    rms_norm_eps=1e-6,
    max_position_embeddings=524288,
    dense_intermediate_size=12288,
    intermediate_size=3072,
)


def config_from_hf(hf: dict[str, Any]) -> MiniMaxM3Config:
    """Read a config.json dict: MiniMaxM3VLTextConfig's fields, or a multimodal config's text_config."""
    tie = bool(hf.get("tie_word_embeddings", False)) or bool(_text(hf).get("tie_word_embeddings", False))
    top, hf = hf, _text(hf)
    if hf.get("quantization_config"):
        raise _refuse("quantization_config", hf["quantization_config"], "quantized checkpoints are not read yet")
    layers, heads = int(hf["num_hidden_layers"]), AttentionHeads.from_hf(hf)
    sparse, moe_layers = _layer_kinds(hf, layers)
    rotary_dim, theta = _rotary(hf, heads.head_dim)
    index_heads = _index_field(hf, "index_n_heads", "sparse_num_index_heads", 4)
    topk = _index_field(hf, "index_topk_blocks", "sparse_topk_blocks", 16)
    local = _index_field(hf, "index_local_blocks", "sparse_local_block", 1)
    block = _index_field(hf, "index_block_size", "sparse_block_size", 128)
    if any(sparse):
        if index_heads < 1 or heads.num_heads % index_heads:
            raise _refuse("index_n_heads", index_heads, f"it must divide num_attention_heads ({heads.num_heads})")
        if topk < 1 or block < 1:
            raise _refuse("index_topk_blocks" if topk < 1 else "index_block_size", min(topk, block), "it must be >= 1")
        if not 0 <= local <= topk:  # more boosted (+inf) blocks than slots: transformers' top-k breaks the tie
            raise _refuse("index_local_blocks", local, f"it must be between 0 and index_topk_blocks ({topk})")
    limit = float(hf.get("swiglu_limit", 7.0))
    if limit <= 0:  # transformers clamps at the limit even when it is 0; the op reads 0 as "no clamp"
        raise _refuse("swiglu_limit", limit, "the clamp bound must be positive")
    shared = int(hf.get("shared_intermediate_size", 3072))
    if any(moe_layers) and shared <= 0:
        raise _refuse("shared_intermediate_size", shared, "every MoE block has a shared expert")
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 128)
    router = moe.RouterSpec(
        num_experts=experts,
        top_k=int(hf.get("num_experts_per_tok", 4)),
        scoring="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.0)),
        has_correction_bias=True,
    )
    return MiniMaxM3Config(
        **_FIELDS.read(hf),
        **heads._asdict(),
        num_layers=layers,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        tie_word_embeddings=tie,
        sparse_layers=sparse,
        moe_layers=moe_layers,
        shared_intermediate_size=shared,
        router=router,
        activation=moe.ExpertActivation("clamped_glu", limit, float(hf.get("swiglu_alpha", 1.702))),
        index_heads=index_heads,
        index_head_dim=_index_field(hf, "index_head_dim", "sparse_index_dim", 128),
        index_block_size=block,
        index_topk_blocks=topk,
        index_local_blocks=local,
        vision=minimax_m3_vision.config_from_hf(top, hf) if _multimodal(top) else None,
    )


def _multimodal(top: dict[str, Any]) -> bool:
    """A vision tower to compile: a vision_config beside the nested text_config and an image token id
    (image_token_id / image_token_index, else the class default) inside the text vocabulary."""
    if not isinstance(top.get("vision_config"), dict) or not isinstance(top.get("text_config"), dict):
        return False
    return 0 <= minimax_m3_vision.image_token_id(top) < int(top["text_config"]["vocab_size"])


def canonical_tensors(config: MiniMaxM3Config, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A multimodal checkpoint's vision tensors in transformers' names, whichever layout it ships
    (MiniMax's vision_tower.vision_model.* / patch_merge_mlp.* or transformers' model.vision_tower.*);
    a text-only config refuses them."""
    if config.vision is None:
        refuse_vision_tensors(tensors, minimax_m3_vision.VISION_PREFIXES)
        return tensors
    return minimax_m3_vision.native_tensors(tensors)


def kv_shape(config: MiniMaxM3Config) -> tuple[int, int, int]:
    return config.num_layers, config.num_kv_heads, config.head_dim


def extra_caches(config: MiniMaxM3Config) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """The indexer keys: one [index_head_dim] row per token in each sparse layer (KvLayout.extra)."""
    layers = config.sparse_layer_ids
    return (("index_keys", layers, 1, config.index_head_dim),) if layers else ()


def decode_weight_bytes(config: MiniMaxM3Config, weights: dict[str, Tensor]) -> int:
    text = {k: v for k, v in weights.items() if not k.startswith("vision.")}  # the tower runs per image, not per step
    return moe.decode_weight_bytes(config, text, config.router.top_k)


# ---------------------------------------------------------------------------- step program


class StepProgram(StepModule):
    """The step over kv_cache = [k0, v0, k1, v1, ..., then one indexer-key cache per sparse layer] (KvLayout.extra)."""

    multimodal = True

    def __init__(self, config: MiniMaxM3Config, num_top: int, explicit_ids: bool, scored: bool) -> None:
        super().__init__(config, num_top, explicit_ids, scored)
        self.index_cache = {layer: 2 * config.num_layers + n for n, layer in enumerate(config.sparse_layer_ids)}

    def attention(
        self,
        weights: dict[str, Tensor],
        layer: int,
        h: Tensor,
        rope: tuple[Tensor, ...],
        kv_cache: list[Tensor],
        paged: Paged,
    ) -> Tensor:
        """h [T, hidden] in the core dtype -> attention output [T, hidden] fp32."""
        p, c = f"layers.{layer}.", self.config
        slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
        cos, sin, idx_cos, idx_sin = rope
        q = F.linear(h, weights[p + "wq"]).view(-1, c.num_heads, c.head_dim)
        k = F.linear(h, weights[p + "wk"]).view(-1, c.num_kv_heads, c.head_dim)
        q, k = (
            offset_norm(q, weights[p + "q_norm"], c.rms_norm_eps),
            offset_norm(k, weights[p + "k_norm"], c.rms_norm_eps),
        )
        v = F.linear(h, weights[p + "wv"]).view(-1, c.num_kv_heads, c.head_dim)
        q, k = partial_rotary(q, cos, sin), partial_rotary(k, cos, sin)
        k_cache, v_cache = kv_cache[2 * layer], kv_cache[2 * layer + 1]
        kvt = k_cache.dtype
        torch.ops.flare.write_kv(k_cache, v_cache, k.to(kvt), v.to(kvt), slot_mapping)
        scale = c.head_dim**-0.5
        if c.sparse_layers[layer]:
            idx_q = F.linear(h, weights[p + "idx_wq"]).view(-1, c.index_heads, c.index_head_dim)
            idx_k = F.linear(h, weights[p + "idx_wk"]).view(-1, 1, c.index_head_dim)
            idx_q = partial_rotary(offset_norm(idx_q, weights[p + "idx_q_norm"], c.rms_norm_eps), idx_cos, idx_sin)
            idx_k = partial_rotary(offset_norm(idx_k, weights[p + "idx_k_norm"], c.rms_norm_eps), idx_cos, idx_sin)
            idx_cache = kv_cache[self.index_cache[layer]]
            torch.ops.flare.write_kv(idx_cache, idx_cache, idx_k.to(kvt), idx_k.to(kvt), slot_mapping)
            blocks = torch.ops.flare.block_select(
                idx_q.to(kvt),
                idx_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                positions,
                c.index_block_size,
                c.index_topk_blocks,
                c.index_local_blocks,
            )
            attn = torch.ops.flare.block_sparse_attention(
                q.to(kvt),
                k_cache,
                v_cache,
                blocks,
                block_tables,
                seq_lens,
                query_start_loc,
                positions,
                scale,
                c.index_block_size,
            )
        else:
            attn = torch.ops.flare.paged_attention(
                q.to(kvt), k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale
            )
        # row-parallel o on tp ranks (each its query heads): the partial sums meet here
        return self.reduce(F.linear(attn.reshape(-1, c.num_heads * c.head_dim).to(h.dtype), weights[p + "wo"]).float())

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        """On tp ranks each rank's share of the widths (or of the experts) and of the shared expert: summed."""
        c, p = self.config, f"layers.{layer}."
        if c.moe_layers[layer]:
            out = moe.sparse_moe(moe.MoeBlock(c.router, c.activation, shared=True), weights, layer, h)
        else:
            out = moe.shared_mlp(h, weights[p + "w_gate_up"], weights[p + "w_down"], c.activation)
        return self.reduce(out)

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Vision cores: the image rows' input embeddings are the features."""
        c = self.config
        wdt = weights["embed"].dtype
        # Residual stream, norms and rotary in fp32, matmuls in the core dtype (as the other families).
        x = embed_images(self.embed_tokens(weights, s.token_ids), s)
        positions = s.positions
        inv_freq = theta_powers(positions, c.rotary_dim, c.rope_theta)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        cos, sin = emb.cos(), emb.sin()
        # The indexer takes cos/sin truncated to its head width, as transformers slices them.
        rope = (cos, sin, cos[..., : c.index_head_dim], sin[..., : c.index_head_dim])
        for i in range(c.num_layers):
            h = offset_norm(x, weights[f"layers.{i}.attn_norm"], c.rms_norm_eps).to(wdt)
            x = x + self.attention(weights, i, h, rope, kv_cache, s.paged)
            h = offset_norm(x, weights[f"layers.{i}.mlp_norm"], c.rms_norm_eps).to(wdt)
            x = x + self.mlp(weights, i, h).float()
        x = offset_norm(x, weights["norm"], c.rms_norm_eps).to(wdt)
        return self.outputs(x, weights, s)


# ---------------------------------------------------------------------- plain reference


def canonical_name(name: str) -> str:
    """A text tensor's MiniMaxM3VLForCausalLM-style name (prefixes and MiniMax's module names undone;
    per-expert w1/w2/w3 stay per expert)."""
    name = without_prefixes(name, _TEXT_PREFIXES).replace(".self_attn.index_", ".self_attn.indexer.")
    if ".block_sparse_moe." in name:
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        name = name.replace(".block_sparse_moe.", ".mlp.")
    return name


def _reference_select(scores: Tensor, positions: Tensor, c: MiniMaxM3Config) -> Tensor:
    """[Hi, T, T] fp64 indexer scores -> [Hi, T, num_blocks] bool chosen blocks, one query at a time:
    the local blocks, then the best others by their best visible key, up to index_topk_blocks."""
    heads, total, _ = scores.shape
    size = c.index_block_size
    num_blocks = -(-total // size)
    chosen = torch.zeros(heads, total, num_blocks, dtype=torch.bool)
    for t in range(total):
        own = int(positions[t]) // size
        local = {max(own - n, 0) for n in range(c.index_local_blocks)}
        for g in range(heads):
            best = [float(scores[g, t, b * size : min((b + 1) * size, t + 1)].max()) for b in range(own + 1)]
            others = sorted((b for b in range(own + 1) if b not in local), key=lambda b: -best[b])
            for b in sorted(local) + others[: max(c.index_topk_blocks - len(local), 0)]:
                chosen[g, t, b] = True
    return chosen


def reference_logits(
    config: MiniMaxM3Config, hf_weights: dict[str, Tensor], token_ids: list[int], images: PromptImages | None = None
) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights (any of the layouts WEIGHT_MAP reads):
    logits [T, V] fp32. Independent of the program path: explicit attention matrices, the
    indexer's choice made query by query (sorting, not top-k), rotary from float64 angles.
    The prompt's `images` replace their positions' input embeddings."""
    c = config
    w = {canonical_name(k): v.float() for k, v in hf_weights.items()}
    total = len(token_ids)
    positions = torch.arange(total)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    if images is not None:
        images.splice(x)
    inv = c.rope_theta ** (-torch.arange(0, c.rotary_dim, 2, dtype=torch.float64) / c.rotary_dim)
    angles = torch.cat([positions[:, None] * inv[None, :]] * 2, dim=-1)  # [T, rotary_dim]
    cos, sin = angles.cos().float(), angles.sin().float()

    def norm(t: Tensor, weight: Tensor) -> Tensor:
        return (1.0 + weight) * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def rotate(t: Tensor, width: int) -> Tensor:  # t [heads, T, D]; the first `width` channels of cat(f, f)
        cw, sw = cos[:, :width], sin[:, :width]
        a, b = t[..., : width // 2], t[..., width // 2 : width]
        return torch.cat([t[..., :width] * cw + torch.cat([-b, a], dim=-1) * sw, t[..., width:]], dim=-1)

    def act(gate: Tensor, up: Tensor) -> Tensor:
        a = c.activation
        gate, up = gate.clamp(max=a.limit), up.clamp(-a.limit, a.limit)
        return (up + 1.0) * gate / (1.0 + torch.exp(-a.alpha * gate))

    def fused_or_split(prefix: str) -> tuple[Tensor, Tensor]:
        if prefix + "gate_up_proj.weight" in w:
            return w[prefix + "gate_up_proj.weight"].chunk(2, dim=0)
        return w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]

    def glu_mlp(prefix: str, h: Tensor) -> Tensor:
        gate, up = fused_or_split(prefix)
        return act(h @ gate.T, h @ up.T) @ w[prefix + "down_proj.weight"].T

    causal = positions[None, :] <= positions[:, None]  # [T, T]
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = norm((h @ w[a + "q_proj.weight"].T).view(total, c.num_heads, c.head_dim), w[a + "q_norm.weight"])
        k = norm((h @ w[a + "k_proj.weight"].T).view(total, c.num_kv_heads, c.head_dim), w[a + "k_norm.weight"])
        v = (h @ w[a + "v_proj.weight"].T).view(total, c.num_kv_heads, c.head_dim).transpose(0, 1)
        q, k = rotate(q.transpose(0, 1), c.rotary_dim), rotate(k.transpose(0, 1), c.rotary_dim)
        visible = causal.expand(c.num_heads, total, total)
        if c.sparse_layers[i]:
            width = min(c.index_head_dim, c.rotary_dim)
            iq = (h @ w[a + "indexer.q_proj.weight"].T).view(total, c.index_heads, c.index_head_dim)
            ik = (h @ w[a + "indexer.k_proj.weight"].T).view(total, 1, c.index_head_dim)
            iq = rotate(norm(iq, w[a + "indexer.q_norm.weight"]).transpose(0, 1), width)
            ik = rotate(norm(ik, w[a + "indexer.k_norm.weight"]).transpose(0, 1), width)
            scores = iq.double() @ ik.double().transpose(1, 2)  # [Hi, T, T]
            chosen = _reference_select(scores, positions, c)  # [Hi, T, blocks]
            per_key = chosen[..., positions // c.index_block_size]  # [Hi, T, T]
            visible = visible & per_key.repeat_interleave(c.num_heads // c.index_heads, dim=0)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2) / math.sqrt(c.head_dim)).masked_fill(~visible, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(total, -1)
        x = x + attn @ w[a + "o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        if c.moe_layers[i]:
            routed = moe.reference_moe(  # the shared expert added below
                moe.MoeBlock(c.router, c.activation),
                w,
                p + "mlp.",
                h,
                names=("w1", "w3", "w2")
                if p + "mlp.experts.0.w1.weight" in w
                else ("gate_proj", "up_proj", "down_proj"),
            )
            x = x + routed + glu_mlp(p + "mlp.shared_experts.", h)
        else:
            x = x + glu_mlp(p + "mlp.", h)
    x = norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry MiniMax M3's special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "minimax_m3"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny MiniMaxM3VLForCausalLM config: 3 layers (sparse, full, sparse attention; dense, MoE,
    MoE MLPs), GQA 4/2 heads of 16 with 8 rotated channels, an indexer of 2 heads x 16 over
    blocks of 4 keys keeping 3 (one local), 8 experts top-2 plus a shared expert, clamp 1.0
    so random activations reach it."""
    return {
        "architectures": ["MiniMaxM3VLForCausalLM"],
        "model_type": "minimax_m3_vl_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "layer_types": [SPARSE, FULL, SPARSE],
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "dense_intermediate_size": 96,
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.0,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 1.0,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_block_size": 4,
        "index_topk_blocks": 3,
        "index_local_blocks": 1,
        "tie_word_embeddings": False,
        "bos_token_id": None,  # the template writes its own ]~!b[; the class default is outside this vocabulary
        "torch_dtype": "float32",
    }


def _text_shapes(c: MiniMaxM3Config) -> dict[str, tuple[int, ...]]:
    """transformers' MiniMaxM3VLForCausalLM tensor names and shapes (stacked experts, fused gate/up)
    (hf_shapes nests them as MiniMaxM3SparseForConditionalGeneration does for a multimodal config)."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    e, f, s = c.router.num_experts, c.intermediate_size, c.shared_intermediate_size
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + name: shape for name, shape in (attention_shapes(c) | qk_norm_shapes(c)).items()})
        if c.sparse_layers[layer]:
            i = p + "self_attn.indexer."
            shapes.update(
                {
                    i + "q_proj.weight": (c.index_heads * c.index_head_dim, h),
                    i + "k_proj.weight": (c.index_head_dim, h),
                    i + "q_norm.weight": (c.index_head_dim,),
                    i + "k_norm.weight": (c.index_head_dim,),
                }
            )
        m = p + "mlp."
        if not c.moe_layers[layer]:
            d = c.dense_intermediate_size
            shapes.update({m + "gate_up_proj.weight": (2 * d, h), m + "down_proj.weight": (h, d)})
            continue
        shapes.update(
            {
                m + "gate.weight": (e, h),
                m + "gate.e_score_correction_bias": (e,),
                m + "experts.gate_up_proj": (e, 2 * f, h),
                m + "experts.down_proj": (e, h, f),
                m + "shared_experts.gate_up_proj.weight": (2 * s, h),
                m + "shared_experts.down_proj.weight": (h, s),
            }
        )
    return shapes


hf_shapes = vision_hooks.nested_shapes(_text_shapes, minimax_m3_vision)


# Test vision checkpoints: the "minimax_m3" chat flavour plus the processor's framing tokens.
TESTMODEL_VISION_TOKENS = (*vision_hooks.image_tokens(minimax_m3_vision), "]<]video[>[")


def testmodel_vision(text: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """A tiny multimodal (MiniMaxM3SparseForConditionalGeneration) config around testmodel_config's text
    model: a 2-layer vision tower of width 32 (2 heads of 16, 12 of them rotated over 3 axes) over
    14-pixel patches of 2 frames, 2 x 2 merging, a projector of width 48. `tokens`:
    TESTMODEL_VISION_TOKENS -> ids."""
    vision = {
        "model_type": "minimax_m3_vl_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
    }
    return nested_testmodel(
        "MiniMaxM3SparseForConditionalGeneration",
        "minimax_m3_vl",
        text,
        vision,
        projector_hidden_size=48,
        image_token_id=tokens[minimax_m3_vision.IMAGE_TOKEN],
        video_token_id=tokens["]<]video[>["],
    )


# MiniMaxM3VLImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json): 4 .. 64
# tokens of 28 x 28 pixels per image.
TESTMODEL_PROCESSOR = merged_patch_processor(
    "MiniMaxM3VLImageProcessor",
    minimax_m3_vision.PROCESSOR_DEFAULTS,
    size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28},
)


# The multimodal test checkpoint (ignition.testmodel --vision).
TINY_VISION = TinyVision(testmodel_vision, "minimax_m3-vision", TESTMODEL_VISION_TOKENS, TESTMODEL_PROCESSOR)

# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits, features=vision_hooks.reference_features(minimax_m3_vision)),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, vision=TINY_VISION),
    vision=vision_hooks.of(minimax_m3_vision),
)
