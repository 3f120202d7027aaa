"""The glm_moe_dsa family: GLM-5's architecture (transformers' GlmMoeDsaForCausalLM), DeepSeek
Sparse Attention over multi-head latent attention with sigmoid-routed MoE.

Attention is the kimi_k3 family's absorbed MLA over one shared latent row per token
(ignition.models.deepseek_v3, reused), except that each query attends only to the keys
its layer's lightning indexer selects: the indexer's own heads score every visible key
(ReLU of q.k per head, weighted per query and summed) against indexer keys kept in a
second paged cache beside the latent (KvLayout.extra, "indexer_k"), and the top
`index_topk` are attended (`flare::indexer_topk` + `flare::sparse_paged_attention`,
helios.core.ops_sparse). Layers marked "shared" in `indexer_types` reuse the previous full
layer's selection and have no indexer. Rotary is always interleaved (main and indexer).
MLPs follow `mlp_layer_types`: dense SwiGLU or the DeepSeek-V3 router with shared experts.
Checked against transformers 5.24 `GlmMoeDsaForCausalLM` (models/glm_moe_dsa).

GLM-5.3-Flash itself is transformers' glm5_next (Glm5NextForConditionalGeneration: KDA linear
attention layers, hyper-connection residual streams, a k-pool indexer, NoPE MLA, a vision
tower), compiled by the glm5_next family (the glm53 recipe); its configs are refused here by name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import deepseek_v3 as mla
from ignition.models import deepseek_v3_config as mla_config
from ignition.models import moe
from ignition.models.common import reference_swiglu
from ignition.models.deepseek_v3 import Attend, Rotary
from ignition.models.family import Family, Reference, TinyCheckpoint
from ignition.models.hf_config import REQUIRED, Fields, Key, grouped_sigmoid_router
from ignition.models.step import Paged

NAME = "glm_moe_dsa"
HF_ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
HF_MODEL_TYPES = ("glm_moe_dsa",)

SHARED_KV = True  # the latent cache, as kimi_k3's; the indexer keys are extra_caches
INDEXER_CACHE = "indexer_k"
INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm is an nn.LayerNorm built with eps 1e-6
LATENT_NORM_EPS = mla_config.LATENT_NORM_EPS

_INDEXER_WEIGHT_MAP = {
    "model.layers.{}.self_attn.indexer.wq_b.weight": "layers.{}.idx_wq_b",
    "model.layers.{}.self_attn.indexer.wk.weight": "layers.{}.idx_wk",
    "model.layers.{}.self_attn.indexer.k_norm.weight": "layers.{}.idx_k_norm",
    "model.layers.{}.self_attn.indexer.k_norm.bias": "layers.{}.idx_k_norm_bias",
    "model.layers.{}.self_attn.indexer.weights_proj.weight": "layers.{}.idx_weights_proj",
}
# kimi_k3's text names (DeepseekV3ForCausalLM's layout is GLM-5's), without the plain q_proj: DSA needs the q LoRA.
WEIGHT_MAP = {k: v for k, v in mla_config.TEXT_WEIGHT_MAP.items() if not k.endswith("self_attn.q_proj.weight")}
WEIGHT_MAP |= _INDEXER_WEIGHT_MAP
STACKED = mla_config.STACKED
FUSED = mla_config.FUSED

# transformers' GLM-5.3-Flash (glm5_next): another architecture, named in the refusal.
_GLM5_NEXT = ("glm5_next", "glm5_next_text", "Glm5NextForConditionalGeneration", "Glm5NextForCausalLM")


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class GlmMoeDsaConfig(mla_config.DeepseekV3Config):
    index_topk: int  # keys each query attends to (all visible ones when fewer)
    index_n_heads: int
    index_head_dim: int  # its first qk_rope_head_dim dims are rotated
    indexer_types: tuple[str, ...]  # per layer: "full" runs the indexer, "shared" reuses the previous full layer's
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" or "sparse" (MoE)

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Layers with their own indexer, in order (one indexer-key cache tensor each)."""
        return tuple(i for i, kind in enumerate(self.indexer_types) if kind == "full")


def _indexer_types(hf: dict[str, Any], layers: int) -> tuple[str, ...]:
    """transformers' GlmMoeDsaConfig.__post_init__: explicit types, else a pattern, else freq/offset."""
    if hf.get("indexer_types") is not None:
        return tuple(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[ch] for ch in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))


def _check_supported(hf: dict[str, Any]) -> None:
    names = {hf.get("model_type"), *(hf.get("architectures") or [])}
    if names & set(_GLM5_NEXT):
        raise ValueError(
            f"model_type {hf.get('model_type')!r} is GLM-5.3-Flash's glm5_next architecture (KDA linear attention, "
            f"hyper-connections, k-pool indexer, vision tower), not {NAME}: the glm5_next family compiles it "
            f"(recipe glm53)"
        )
    if hf.get("q_lora_rank") is None:
        raise ValueError(f"q_lora_rank is required by the {NAME} family (the indexer reads the q LoRA)")
    for field in ("attention_bias", "quantization_config"):
        if hf.get(field):
            raise ValueError(f"{field} is not supported by the {NAME} family")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported by the {NAME} family")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads must equal num_attention_heads in the {NAME} family")
    kinds = set(hf.get("layer_types") or ["indexed_attention"])
    if kinds != {"indexed_attention"}:
        raise ValueError(f"layer_types {sorted(kinds)} are not supported by the {NAME} family (indexed_attention)")


# The fields read as they stand in config.json; GlmMoeDsaConfig's defaults for the optional ones.
_FIELDS = Fields(
    GlmMoeDsaConfig,
    vocab_size=REQUIRED,
    hidden_size=REQUIRED,
    intermediate_size=12288,
    num_heads=Key("num_attention_heads"),
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    v_head_dim=256,
    rms_norm_eps=1e-5,
    max_position_embeddings=202752,
    tie_word_embeddings=False,
    moe_intermediate_size=2048,
    index_n_heads=32,
)


def config_from_hf(hf: dict[str, Any]) -> GlmMoeDsaConfig:
    """Read a Hugging Face config.json dict, with GlmMoeDsaConfig's defaults for absent fields."""
    _check_supported(hf)
    layers = int(hf["num_hidden_layers"])
    n_dense = min(int(hf.get("first_k_dense_replace", 3)), layers)
    mlp_types = tuple(hf.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (layers - n_dense))
    indexer_types = _indexer_types(hf, layers)
    if len(mlp_types) != layers or set(mlp_types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {layers} layers")
    if len(indexer_types) != layers or set(indexer_types) - {"full", "shared"}:
        raise ValueError(f"indexer_types must name 'full' or 'shared' for each of the {layers} layers")
    if indexer_types[0] != "full":
        raise ValueError("indexer_types: a 'shared' layer needs an earlier 'full' layer (layer 0 is shared)")
    rope_dim, index_dim = int(hf["qk_rope_head_dim"]), int(hf.get("index_head_dim", 128))
    if index_dim < rope_dim:
        raise ValueError(f"index_head_dim {index_dim} is smaller than qk_rope_head_dim {rope_dim}")
    topk = int(hf.get("index_topk", 2048))
    if topk < 1:
        raise ValueError(f"index_topk must be positive, got {topk}")
    router = glm_router(hf, default_experts=256)
    return GlmMoeDsaConfig(
        **_FIELDS.read(hf),
        num_layers=layers,
        q_lora_rank=int(hf["q_lora_rank"]),  # required here (the indexer reads it)
        qk_rope_head_dim=rope_dim,
        rope=mla_config.rope_from_hf(hf, NAME, interleave=True),
        first_k_dense_replace=n_dense,
        n_shared_experts=int(hf.get("n_shared_experts", 1) or 0),
        router=router,
        num_mtp_layers=0,  # GLM's MTP layers are not compiled (kimi_k3's are)
        index_topk=topk,
        index_head_dim=index_dim,
        indexer_types=indexer_types,
        mlp_layer_types=mlp_types,
    )


def kv_shape(config: GlmMoeDsaConfig) -> tuple[int, int, int]:
    """(num_layers, 1, latent_dim): one shared latent row per token (SHARED_KV)."""
    return mla_config.kv_shape(config)


def extra_caches(config: GlmMoeDsaConfig) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """One indexer-key row [index_head_dim] per token for each layer with its own indexer (KvLayout.extra)."""
    return ((INDEXER_CACHE, tuple(config.indexer_layers), 1, config.index_head_dim),)


def decode_weight_bytes(config: GlmMoeDsaConfig, weights: dict[str, Tensor]) -> int:
    return moe.decode_weight_bytes(config, weights, config.router.top_k)


# ---------------------------------------------------------------------------- step program


class StepProgram(mla.StepProgram):
    """forward(weights, kv_cache, *inputs) per helios.core.program.program_signature, with
    kv_cache = [latent_0, ..., latent_{L-1}, indexer_k of each full indexer layer in order]:
    latents [pages, page_tokens, 1, latent_dim], indexer keys [pages, page_tokens, 1, index_head_dim]."""

    config: GlmMoeDsaConfig

    def attender(self, weights: dict[str, Tensor], kv_cache: list[Tensor], rotary: Rotary, paged: Paged) -> Attend:
        """Sparse MLA: each layer attends the keys its last full indexer layer selected (layer 0 is one)."""
        c = self.config
        cos, sin = rotary
        index_caches = dict(zip(c.indexer_layers, kv_cache[c.num_layers :], strict=True))
        selected: Tensor | None = None  # [T, index_topk] key positions of the last full indexer layer

        def attend(i: int, h: Tensor) -> Tensor:
            nonlocal selected
            q_resid = self.q_resid(weights, i, h)
            assert q_resid is not None  # config_from_hf requires the q LoRA
            cache = kv_cache[i]
            query, latent = self.latent_inputs(weights, i, h, q_resid, cos, sin, cache.dtype)
            torch.ops.flare.write_kv(cache, cache, latent, latent, paged[0])
            if i in index_caches:
                selected = self.indexer(weights, i, h, q_resid, cos, sin, index_caches[i], paged)
            assert selected is not None  # layer 0 is a full indexer layer (config_from_hf)
            slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
            attn = torch.ops.flare.sparse_paged_attention(
                query, cache, cache, block_tables, seq_lens, query_start_loc, positions, selected, c.softmax_scale
            )
            return self.latent_output(weights, i, attn, h.dtype)

        return attend

    def indexer(
        self,
        weights: dict[str, Tensor],
        layer: int,
        h: Tensor,
        q_resid: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Tensor,
        paged: Paged,
    ) -> Tensor:
        """Write this step's indexer keys and select each query's top-k keys: [T, index_topk] int64."""
        p, c = f"layers.{layer}.", self.config
        slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
        heads, dim, rope = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        q = F.linear(q_resid, weights[p + "idx_wq_b"]).float().view(-1, heads, dim)
        k = F.layer_norm(
            F.linear(h, weights[p + "idx_wk"]).float(),
            (dim,),
            weights[p + "idx_k_norm"].float(),
            weights[p + "idx_k_norm_bias"].float(),
            INDEXER_NORM_EPS,
        )[:, None, :]
        # Interleaved rotary over the first `rope` dims, as in the main attention (same layout for q and k).
        q = torch.cat([mla.apply_rope(q[..., :rope], cos, sin, True), q[..., rope:]], dim=-1)
        k = torch.cat([mla.apply_rope(k[..., :rope], cos, sin, True), k[..., rope:]], dim=-1).to(cache.dtype)
        torch.ops.flare.write_kv(cache, cache, k, k, slot_mapping)
        # transformers keeps weights_proj in fp32 (_keep_in_fp32_modules) and folds in 1/sqrt(heads).
        head_weights = F.linear(h.float(), weights[p + "idx_weights_proj"].float()) * heads**-0.5
        return torch.ops.flare.indexer_topk(
            q, head_weights, cache, block_tables, seq_lens, query_start_loc, positions, dim**-0.5, c.index_topk
        )


# ---------------------------------------------------------------------- plain reference


def reference_selection(
    c: GlmMoeDsaConfig, w: dict[str, Tensor], prefix: str, h: Tensor, q_resid: Tensor, rotate: Any
) -> Tensor:
    """The indexer under `prefix` ("model.layers.N.self_attn.indexer.") over a whole sequence:
    [T, T] bool, key j kept for query i. Dense scores, then a stable sort per query (ties to the
    earlier key), independent of the ops' top-k path."""
    total, heads, dim, rope = h.shape[0], c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    q = (q_resid @ w[prefix + "wq_b.weight"].T).view(total, heads, dim).transpose(0, 1)  # [Hi, T, D]
    k = h @ w[prefix + "wk.weight"].T
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True) + INDEXER_NORM_EPS)
    k = (k * w[prefix + "k_norm.weight"] + w[prefix + "k_norm.bias"])[None]  # [1, T, D]
    q = torch.cat([rotate(q[..., :rope]), q[..., rope:]], dim=-1)
    k = torch.cat([rotate(k[..., :rope]), k[..., rope:]], dim=-1)
    weights = (h @ w[prefix + "weights_proj.weight"].T) * heads**-0.5  # [T, Hi]
    scores = torch.einsum("th,hts->ts", weights, (q @ k.transpose(1, 2) * dim**-0.5).clamp(min=0))
    visible = torch.ones(total, total, dtype=torch.bool).tril()
    order = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(total).expand(total, total))
    return visible & (ranks < c.index_topk)


def reference_logits(config: GlmMoeDsaConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights: logits [T, V] in fp32.

    Non-absorbed MLA (kimi_k3's reference_mla) under an additive mask of the indexer's
    selection, computed densely over the whole sequence with complex-number rotary.
    """
    c = config
    w = {k: v.float() for k, v in hf_weights.items()}
    total = len(token_ids)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    angles = mla.reference_angles(c.rope, total)

    def rotate(t: Tensor) -> Tensor:
        return mla.reference_rotate(t, angles, c.rope.cos_sin_scale, True)

    kept = torch.zeros(total, total, dtype=torch.bool)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = mla.reference_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        if c.indexer_types[i] == "full":
            q_resid = mla.reference_q_resid(c, w, a, h)
            assert q_resid is not None
            kept = reference_selection(c, w, a + "indexer.", h, q_resid, rotate)
        mask = torch.zeros(total, total).masked_fill(~kept, float("-inf"))
        x = x + mla.reference_mla(c, w, a, h, rotate, mask)
        h = mla.reference_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        if c.is_moe(i):
            x = x + moe.reference_moe(c.moe_block, w, p + "mlp.", h)
        else:
            x = x + reference_swiglu(w, p + "mlp.", h)
    x = mla.reference_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry GLM-5.3-Flash's special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "glm53"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny GLM-5 config: kimi_k3's test sizes (3 layers, the first dense; 8 sigmoid-routed experts
    top-2, a shared expert) in one expert group, and the indexer full / shared / full keeping 8 keys
    (so 24-token prompts drop keys)."""
    kimi = mla.testmodel_config(vocab_size)
    for field in ("rope_interleave", "rope_theta", "num_nextn_predict_layers"):  # fields GLM-5 configs lack
        del kimi[field]
    return kimi | {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "index_topk": 8,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "indexer_types": ["full", "shared", "full"],
        "n_group": 1,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def hf_shapes(c: GlmMoeDsaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes (per-expert layout) of a checkpoint with this config."""
    shapes = mla.hf_shapes(c)
    for layer in range(c.num_layers):
        if layer in c.indexer_layers:
            p = f"model.layers.{layer}.self_attn.indexer."
            shapes.update(
                {
                    p + "wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                    p + "wk.weight": (c.index_head_dim, c.hidden_size),
                    p + "k_norm.weight": (c.index_head_dim,),
                    p + "k_norm.bias": (c.index_head_dim,),
                    p + "weights_proj.weight": (c.index_n_heads, c.hidden_size),
                }
            )
    return shapes


def glm_router(hf: dict, default_experts: int) -> moe.RouterSpec:
    """GLM's MoE router (GLM-5 and GLM-5.3): sigmoid scores with a correction bias, group-limited."""
    experts, top_k = int(hf.get("n_routed_experts", default_experts)), int(hf.get("num_experts_per_tok", 8))
    return grouped_sigmoid_router(hf, experts, top_k, float(hf.get("routed_scaling_factor", 2.5)))


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT),
)
