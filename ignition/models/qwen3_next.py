"""The qwen3_next family: Qwen's hybrid decoders, gated DeltaNet (linear attention) layers
between gated full-attention layers: Qwen3NextForCausalLM (MoE), and the text models of
Qwen3.5 (Qwen3_5ForCausalLM, dense) and Qwen3.5-MoE (Qwen3_5MoeForCausalLM), also read from
their multimodal checkpoints (nested text_config, weights under model.language_model.).

What it computes, as transformers 5.24's modeling_qwen3_next / qwen3_5 / qwen3_5_moe do:
- Zero-centred RMSNorm `x / rms(x) * (1 + w)` (input, post-attention, final, per-head q/k).
- `layer_types` (or every `full_attention_interval`-th layer) full attention, the rest linear.
- Full attention: q_proj yields per head [query | output gate]; q/k norms; rotary over the
  first head_dim * partial_rotary_factor dims (rotate-half, the rest passes); paged causal
  attention scaled by head_dim**-0.5; the output times sigmoid(gate) before o_proj. Qwen3.5's
  multimodal rotary (mrope sections) equals this for text, whose three position ids coincide.
- Gated DeltaNet: projections to q, k, v (one conv channel block), the gate z, b and a
  (Qwen3-Next fuses them per key head in in_proj_qkvz / in_proj_ba, Qwen3.5 keeps separate
  in_proj_qkv / _z / _b / _a); depthwise causal conv1d + SiLU over [q | k | v]
  (flare::causal_conv1d, its window in a state slot); L2-normalized q, k; beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule (flare::gated_delta_rule, its
  [heads, k_dim, v_dim] state in a slot); RMSNorm(o) * w * silu(z); out_proj.
- MLP: dense SwiGLU, or (Qwen3-Next per decoder_sparse_step / mlp_only_layers, Qwen3.5-MoE
  every layer) softmax top-k routing (renormalized with norm_topk_prob; always for Qwen3.5-MoE)
  plus a shared expert scaled by sigmoid(shared_expert_gate(h)).
- Multi-token prediction (`mtp_num_hidden_layers` or `num_nextn_predict_layers` layers under
  `mtp.`, which transformers does not load), as vLLM's qwen3_next_mtp / qwen3_5_mtp serve it:
  pre_fc_norm_embedding(embedding of the next token) and pre_fc_norm_hidden(the main model's
  final-normed hidden state) concatenated [embedding | hidden], projected by `fc` (shared by the
  MTP layers), one gated full-attention decoder layer (its own KV on the step's pages: two
  KvLayout.extra "mtp_kv" caches, keys then values) with the MLP a layer of that index would
  have, normed by the MTP `norm` and scored by the shared head. Each MTP layer is exported as
  "mtp_draft.N" (ignition.models.mtp) and the step programs then also return the final-normed
  hidden states. No transformers reference: `reference_mtp` in qwen3_next_reference is ours.
Left out at export: the vision tower (model.visual.*); MTP layers when the config declares none.
The plain-torch reference forward is in qwen3_next_reference.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops.gated_delta  # noqa: F401  (defines flare::gated_delta_rule)
from ignition.models import moe, mtp, qwen3_next_config
from ignition.models import qwen3_next_reference as ref
from ignition.models.common import offset_norm, partial_rotary, rope, swiglu, swiglu_shapes
from ignition.models.family import Family, Reference, TinyCheckpoint
from ignition.models.qwen3_next_config import FULL, LINEAR, Qwen3NextConfig
from ignition.models.step import Paged, StatefulStepModule, StepInputs, cached_attention

# ---------------------------------------------------------------------------- step program


class StepProgram(StatefulStepModule):
    """The step over kv_cache = [k0, v0, ..., k{L-1}, v{L-1}, (the MTP layers' keys, then values,) conv
    states of the DeltaNet layers, their delta-rule states]; with MTP layers it also returns the
    final-normed hidden state of every row (what mtp_draft.N takes)."""

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        c = self.config
        eps = c.rms_norm_eps
        # Weights and matmul inputs in the core's dtype; the residual stream, norms, rotary and
        # recurrent state in fp32.
        wdt = weights["embed"].dtype
        x = F.embedding(s.token_ids, weights["embed"]).float()
        cos, sin = rope(s.positions, c.rotary_dim, c.rope_theta, torch.float32)
        linear = {layer: j for j, layer in enumerate(c.linear_layers)}
        states = kv_cache[2 * (c.num_layers + c.num_mtp_layers) :]  # conv, then delta-rule states, of the linear layers
        steps = s.recurrent
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            h = offset_norm(x, weights[p + "attn_norm"], eps).to(wdt)
            if kind == LINEAR:
                j = linear[i]
                mixed = self.gated_delta_net(weights, i, h, states[j], states[len(linear) + j], steps)
            else:
                mixed = attention(c, weights, p, h, kv_cache[2 * i], kv_cache[2 * i + 1], cos, sin, s.paged)
            x = x + mixed
            h = offset_norm(x, weights[p + "mlp_norm"], eps).to(wdt)
            x = x + (routed_mlp(c, weights, p, h) if c.moe_layers[i] else dense_mlp(weights, p, h))
        hidden = offset_norm(x, weights["norm"], eps)
        outputs = self.outputs(hidden.to(wdt), weights, s)
        return (*outputs, hidden) if c.num_mtp_layers else outputs

    def gated_delta_net(self, weights, i, h, conv_state, recurrent_state, steps) -> Tensor:
        """A gated DeltaNet layer over its two state slots: h [T, hidden] -> [T, hidden] fp32."""
        c = self.config
        p = f"layers.{i}."
        kh, vh, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        qkvz = F.linear(h, weights[p + "wqkvz"]).float()
        ba = F.linear(h, weights[p + "wba"]).float()
        if c.grouped_projections:  # per key head: [q, k, v of its value heads, z of its value heads]; [b, a]
            group = vh // kh
            q, k, v, z = qkvz.reshape(-1, kh, 2 * dk + 2 * group * dv).split([dk, dk, group * dv, group * dv], dim=-1)
            mixed = torch.cat([q.reshape(-1, c.key_dim), k.reshape(-1, c.key_dim), v.reshape(-1, c.value_dim)], dim=-1)
            b, a = ba.reshape(-1, kh, 2 * group).split([group, group], dim=-1)
        else:
            mixed, z = qkvz.split([c.conv_dim, c.value_dim], dim=-1)
            b, a = ba.split([vh, vh], dim=-1)
        conv_weight = weights[p + "conv"].reshape(c.conv_dim, c.conv_kernel_size)
        mixed = torch.ops.flare.causal_conv1d(
            mixed, conv_weight, conv_weight.new_zeros(c.conv_dim), conv_state, *steps, True
        )
        q, k, v = mixed.float().split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        beta = torch.sigmoid(b.reshape(-1, vh))
        g = -weights[p + "a_log"].float().exp() * F.softplus(a.reshape(-1, vh) + weights[p + "dt_bias"].float())
        out = torch.ops.flare.gated_delta_rule(
            q.reshape(-1, kh, dk),
            k.reshape(-1, kh, dk),
            v.reshape(-1, vh, dv),
            g,
            beta,
            recurrent_state,
            *steps,
            dk**-0.5,
            True,
        )
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weights[p + "gated_norm"].float()
        out = out * F.silu(z.reshape(-1, vh, dv))
        return F.linear(out.reshape(-1, c.value_dim).to(h.dtype), weights[p + "w_out"]).float()


def attention(
    c: Qwen3NextConfig,
    weights: dict[str, Tensor],
    p: str,
    h: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cos: Tensor,
    sin: Tensor,
    paged: Paged,
) -> Tensor:
    """Gated full attention of the layer whose weights are under `p`: h [T, hidden] -> [T, hidden] fp32."""
    eps = c.rms_norm_eps
    q_dim = c.num_heads * c.head_dim
    q_gate, k, v = F.linear(h, weights[p + "wqkv"]).float().split([2 * q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q, gate = q_gate.reshape(-1, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
    q = partial_rotary(offset_norm(q, weights[p + "q_norm"], eps), cos, sin)
    k = partial_rotary(offset_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), weights[p + "k_norm"], eps), cos, sin)
    v = v.reshape(-1, c.num_kv_heads, c.head_dim)
    attn = cached_attention(q, k, v, k_cache, v_cache, paged, c.head_dim**-0.5).float() * torch.sigmoid(gate)
    return F.linear(attn.reshape(-1, q_dim).to(h.dtype), weights[p + "wo"]).float()


def dense_mlp(weights: dict[str, Tensor], p: str, h: Tensor) -> Tensor:
    return swiglu(weights, p, h).float()


def routed_mlp(c: Qwen3NextConfig, weights, p: str, h) -> Tensor:
    """Routed experts plus the shared expert scaled by sigmoid(shared_expert_gate(h)); fp32 router."""
    top, ids = moe.route(c.router, F.linear(h.float(), weights[p + "w_router"].float()))
    out = moe.routed_mlp(h, top, ids, weights[p + "w_experts_gate_up"], weights[p + "w_experts_down"])
    shared = moe.shared_mlp(h, weights[p + "w_shared_gate_up"], weights[p + "w_shared_down"])
    return out + torch.sigmoid(F.linear(h.float(), weights[p + "w_shared_expert_gate"].float())) * shared


class MtpProgram(mtp.DraftModule):
    """One MTP layer's draft step (ignition.models.mtp's contract); its hidden states are the MTP
    norm's output."""

    def draft(self, weights: dict[str, Tensor], kv_cache: list[Tensor], d: mtp.DraftInputs) -> tuple[Tensor, ...]:
        c, eps, p = self.config, self.config.rms_norm_eps, f"mtp.{self.layer}."
        wdt = weights["embed"].dtype
        embedded = F.embedding(d.token_ids, weights["embed"])
        joined = torch.cat(
            [
                offset_norm(embedded, weights["mtp.pre_fc_norm_embedding"], eps),
                offset_norm(d.hidden, weights["mtp.pre_fc_norm_hidden"], eps),
            ],
            dim=-1,
        )
        x = F.linear(joined.to(wdt), weights["mtp.fc"]).float()
        cos, sin = rope(d.paged.positions, c.rotary_dim, c.rope_theta, torch.float32)
        keys = kv_cache[2 * c.num_layers + self.layer]  # the extra caches: every MTP layer's keys, then values
        values = kv_cache[2 * c.num_layers + c.num_mtp_layers + self.layer]
        h = offset_norm(x, weights[p + "attn_norm"], eps).to(wdt)
        x = x + attention(c, weights, p, h, keys, values, cos, sin, d.paged)
        h = offset_norm(x, weights[p + "mlp_norm"], eps).to(wdt)
        x = x + (routed_mlp(c, weights, p, h) if c.mtp_moe else dense_mlp(weights, p, h))
        out = offset_norm(x, weights["mtp.norm"], eps)
        head = weights["embed"] if c.tie_word_embeddings else weights["lm_head"]
        return self.draft_outputs(out, head, d, wdt)


def extra_programs(config: Qwen3NextConfig, num_top: int, weights: dict[str, Tensor]) -> tuple[mtp.ExtraProgram, ...]:
    """One mtp_draft.N program per MTP layer, checked at export against qwen3_next_reference.reference_mtp."""
    mtp.require_layers(weights, config.num_mtp_layers, lambda k: f"mtp.{k}.wqkv", lambda k: f"mtp.layers.{k}.")
    return mtp.checked_drafts(config, num_top, MtpProgram, ref.reference_forward, ref.reference_mtp)


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Qwen3.5's special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "qwen3.5"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Qwen3NextForCausalLM: DeltaNet layers around one gated attention layer, 4 experts of
    which 2 per token plus the shared expert, one dense layer (mlp_only_layers), untied head."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, LINEAR, FULL, LINEAR],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10_000_000.0,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "intermediate_size": 96,
        "mlp_only_layers": [1],
        "decoder_sparse_step": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def testmodel_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Tensor | None:
    """Zero-centred norms near 0 (scale ~1), slow decays (A in [0.01, 0.3]: the state spans chunks),
    conv and stacked-expert weights scaled by their fan-in."""
    if name.endswith("linear_attn.A_log"):
        return torch.empty(shape).uniform_(0.01, 0.3, generator=generator).log()
    if name.endswith("linear_attn.dt_bias"):
        return 0.3 * torch.randn(shape, generator=generator)
    if name.endswith("linear_attn.conv1d.weight"):  # [C, 1, K]
        return torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name in (
        "model.norm.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ):
        return 0.1 * torch.randn(shape, generator=generator)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, out, in]
        return torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    return None


def hf_shapes(c: Qwen3NextConfig) -> dict[str, tuple[int, ...]]:
    """ForCausalLM tensor names and shapes: Qwen3-Next's fused DeltaNet projections and per-expert
    tensors, Qwen3.5's separate projections and (MoE) transformers 5's stacked experts."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        layer: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        if kind == FULL:
            layer |= _attention_shapes(c)
        else:
            vh = c.linear_num_value_heads
            if c.grouped_projections:
                layer |= {
                    "linear_attn.in_proj_qkvz.weight": (c.conv_dim + c.value_dim, h),
                    "linear_attn.in_proj_ba.weight": (2 * vh, h),
                }
            else:
                layer |= {
                    "linear_attn.in_proj_qkv.weight": (c.conv_dim, h),
                    "linear_attn.in_proj_z.weight": (c.value_dim, h),
                    "linear_attn.in_proj_b.weight": (vh, h),
                    "linear_attn.in_proj_a.weight": (vh, h),
                }
            layer |= {
                "linear_attn.conv1d.weight": (c.conv_dim, 1, c.conv_kernel_size),
                "linear_attn.dt_bias": (vh,),
                "linear_attn.A_log": (vh,),
                "linear_attn.norm.weight": (c.linear_value_head_dim,),
                "linear_attn.out_proj.weight": (h, c.value_dim),
            }
        layer |= _mlp_shapes(c, c.moe_layers[i])
        shapes.update({p + name: shape for name, shape in layer.items()})
    if c.num_mtp_layers:
        shapes |= {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    for k in range(c.num_mtp_layers):
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)} | _attention_shapes(c)
        shapes.update({f"mtp.layers.{k}.{name}": shape for name, shape in (layer | _mlp_shapes(c, c.mtp_moe)).items()})
    return shapes


def _attention_shapes(c: Qwen3NextConfig) -> dict[str, tuple[int, ...]]:
    h, q = c.hidden_size, c.num_heads * c.head_dim
    return {
        "self_attn.q_proj.weight": (2 * q, h),
        "self_attn.k_proj.weight": (c.kv_dim, h),
        "self_attn.v_proj.weight": (c.kv_dim, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
    }


def _mlp_shapes(c: Qwen3NextConfig, routed: bool) -> dict[str, tuple[int, ...]]:
    h = c.hidden_size
    if not routed:
        return swiglu_shapes("mlp.", h, c.intermediate_size)
    e, f, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (e, h)}
    if c.grouped_projections:  # Qwen3-Next's published checkpoints: one tensor per expert
        shapes |= moe.expert_shapes("mlp.", e, h, f)
    else:
        shapes |= {"mlp.experts.gate_up_proj": (e, 2 * f, h), "mlp.experts.down_proj": (e, h, f)}
    return shapes | swiglu_shapes("mlp.shared_expert.", h, s) | {"mlp.shared_expert_gate.weight": (1, h)}


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    qwen3_next_config,
    sys.modules[__name__],
    reference=Reference(ref.reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, init=testmodel_init),
)
