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
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops.glm5_next  # noqa: F401  (defines flare::kda, flare::kpool_topk)
import helios.core.ops.sparse  # noqa: F401  (defines flare::sparse_paged_attention)
from ignition.models import deepseek_v3 as mla
from ignition.models import glm5_next_config, glm5_next_vision, moe, vision_hooks
from ignition.models.common import hyper_block, hyper_residual, rms_norm
from ignition.models.family import Family, Reference, TinyCheckpoint, TinyVision, merged_patch_processor
from ignition.models.glm5_next_config import _TEXT_PREFIX, DENSE, INDEXED, LINEAR, SPARSE, Glm5NextConfig
from ignition.models.glm5_next_reference import reference_logits
from ignition.models.glm_moe_dsa import INDEXER_NORM_EPS
from ignition.models.step import Paged, StatefulStepModule, StepInputs, embed_images

# ---------------------------------------------------------------------------- step program


class StepProgram(StatefulStepModule, mla.StepProgram):
    """forward(weights, kv_cache, *inputs) per helios.core.program.program_signature, with state:
    kv_cache = [latent_0, ..., latent_{L-1}] ([pages, page_tokens, 1, kv_lora_rank]), the indexer
    caches of the full indexer layers ([pages, page_tokens, 1, 2 * index_head_dim]), then the conv
    states of the KDA layers and their delta-rule states. kimi_k3's absorbed-MLA helpers (query,
    latent_output) are inherited."""

    config: Glm5NextConfig

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Vision cores: the image rows' input embeddings are the features."""
        c = self.config
        wdt = weights["embed"].dtype
        n_index, n_linear = len(c.indexer_layers), len(c.linear_layers)
        index_caches = dict(zip(c.indexer_layers, kv_cache[c.num_layers : c.num_layers + n_index], strict=True))
        states = kv_cache[c.num_layers + n_index :]  # conv states, then delta-rule states, of the KDA layers
        linear = {layer: j for j, layer in enumerate(c.linear_layers)}
        paged, steps = s.paged, s.recurrent
        # The hc_mult residual streams, norms and mixing stay fp32; matmuls run in the core dtype.
        x = embed_images(F.embedding(s.token_ids, weights["embed"]).float(), s)
        streams = x[:, None, :].expand(-1, c.hc_mult, -1)
        selected: Tensor | None = None  # [T, width] kept positions of the last full indexer layer
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            post, comb, collapsed = hyper_block(c, weights, p + "attn_hc.", streams)
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
            post, comb, collapsed = hyper_block(c, weights, p + "ffn_hc.", streams)
            h = rms_norm(collapsed, weights[p + "mlp_norm"], c.rms_norm_eps).to(wdt)
            streams = hyper_residual(post, comb, self.mlp(weights, i, h), streams)
        x = rms_norm(streams.mean(dim=1), weights["norm"], c.rms_norm_eps).to(wdt)  # the hyper head: a plain mean
        return self.outputs(x, weights, s)

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
        self, weights: dict[str, Tensor], i: int, h: Tensor, q_resid: Tensor, cache: Tensor, paged: Paged
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
        paged: Paged,
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
            return moe.sparse_moe(c.moe_block, weights, i, h)
        return moe.shared_mlp(h, weights[f"layers.{i}.w_gate_up"], weights[f"layers.{i}.w_down"], c.activation)


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
    *vision_hooks.image_tokens(glm5_next_vision),
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
TESTMODEL_PROCESSOR = merged_patch_processor(
    "Glm5NextImageProcessor", glm5_next_vision.PROCESSOR_DEFAULTS, min_image_tokens=4, max_image_tokens=64
)


# The multimodal test checkpoint (ignition.testmodel --vision).
TINY_VISION = TinyVision(testmodel_vision, TEST_VISION_CHAT, TESTMODEL_VISION_TOKENS, TESTMODEL_PROCESSOR)

# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    glm5_next_config,
    sys.modules[__name__],
    reference=Reference(reference_logits, features=vision_hooks.reference_features(glm5_next_vision)),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, init=testmodel_init, vision=TINY_VISION),
    vision=vision_hooks.of(glm5_next_vision),
)
