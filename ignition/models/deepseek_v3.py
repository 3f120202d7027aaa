"""The kimi_k3 family: the DeepSeek-V3 architecture (DeepSeek-V3/R1, Kimi K2/K2.5/K3 text).

Multi-head latent attention (MLA) with a compressed paged cache: per token the cache holds
ONE vector [kv_lora_rank + qk_rope_head_dim] (normed latent c_kv, rotated shared k_pe), read
as keys and values (KvLayout.shared_kv). The step absorbs kv_b_proj's key half into the
query and its value half after attention, so `flare::paged_attention` runs as MQA over the
latent for prefill and decode alike. MLPs: dense SwiGLU for the first
`first_k_dense_replace` layers, then sigmoid-routed MoE with shared experts (ignition.models.moe).
Checked against transformers 5.24 `DeepseekV3ForCausalLM` (models/deepseek_v3).

Multi-token prediction (`num_nextn_predict_layers` K > 0; transformers does not load them): MTP
layer k is checkpoint layer L = num_hidden_layers + k, as vLLM's and SGLang's deepseek_mtp loaders
read it: `model.layers.L.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}` and
a full decoder layer (MLA, and MoE or dense as is_moe(L) says). Row t: eh_proj(cat(enorm(embed(the
token after t)), hnorm(the main final-normed hidden state at t))) -> the decoder layer over its own
latent cache (KvLayout.extra "mtp_kv", on the step's pages) -> shared_head.norm -> shared_head.head
(the layer's own embed_tokens / shared_head.head when the checkpoint has them, else the main
model's). Each is exported as "mtp_draft.k" (ignition.models.mtp); the step programs then also
return the final-normed hidden states (output "hidden_states"). `reference_mtp` is the plain-torch
reference (there is no transformers one).

Multimodal Kimi K2.5 checkpoints (Kimi_K25ForConditionalGeneration: a vision_config beside the
text_config and an image token id inside the vocabulary, see _multimodal) export a vision program
(kimi_k25_vision.py); the step then takes image_features / image_rows and those rows' input
embeddings are the features (transformers' masked_scatter; its language model takes plain 1-D
positions for image tokens). A text-only config refuses vision tensors; text-only programs are
unchanged (glm_moe_dsa and glm5_next build on this one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import deepseek_v3_config, kimi_k25_vision, moe, mtp, vision_hooks
from ignition.models.common import (
    arange_like,
    decoder_shapes,
    reference_swiglu,
    rms_norm,
    swiglu,
    swiglu_shapes,
    theta_powers,
)
from ignition.models.deepseek_v3_config import LATENT_NORM_EPS, DeepseekV3Config, RopeSpec, canonical_name
from ignition.models.family import Family, PromptImages, Reference, TinyCheckpoint, TinyVision
from ignition.models.kimi_k25_vision import TESTMODEL_PROCESSOR, TESTMODEL_VISION_TOKENS, testmodel_vision
from ignition.models.step import Paged, StepInputs, StepModule, embed_images

# ---------------------------------------------------------------------------- step program


def rope_inv_freq(spec: RopeSpec, like: Tensor) -> Tensor:
    """[dim / 2] fp32 inverse frequencies, YaRN-blended where the spec says (transformers' formula)."""
    base = 1.0 / theta_powers(like, spec.dim, spec.theta)
    if not spec.yarn:
        return 1.0 / base
    low, high = spec.correction_range()
    ramp = ((arange_like(like, spec.dim // 2) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (spec.factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """x [T, heads, D] with cos/sin [T, 1, D/2]. Interleaved pairs come out as (evens, odds)
    halves, as transformers' apply_rotary_pos_emb_interleave writes them (q and k alike)."""
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


Rotary = tuple[Tensor, Tensor]  # cos, sin [T, 1, rope / 2] fp32 (StepProgram.rotary)
# (layer, h [T, hidden] in the core dtype) -> that layer's attention output [T, hidden] fp32.
Attend = Callable[[int, Tensor], Tensor]


class StepProgram(StepModule):
    """The step over kv_cache = [latent_0, latent_1, ...], each [pages, page_tokens, 1, latent_dim]."""

    multimodal = True

    def q_resid(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor | None:
        """The normed q LoRA down-projection [T, q_lora_rank] in h's dtype; None without a q LoRA."""
        p, c = f"layers.{layer}.", self.config
        if c.q_lora_rank is None:
            return None
        q_a = rms_norm(F.linear(h, weights[p + "wq_a"]).float(), weights[p + "q_a_norm"], LATENT_NORM_EPS)
        return q_a.to(h.dtype)

    def query(self, weights: dict[str, Tensor], layer: int, h: Tensor, q_resid: Tensor | None) -> Tensor:
        """h [T, hidden] -> q [T, H, qk_head_dim] fp32, through the q LoRA when the model has one."""
        p, c = f"layers.{layer}.", self.config
        q = F.linear(h, weights[p + "wq"]) if q_resid is None else F.linear(q_resid, weights[p + "wq_b"])
        return q.float().view(-1, c.num_heads, c.qk_head_dim)

    def latent_inputs(
        self,
        weights: dict[str, Tensor],
        layer: int,
        h: Tensor,
        q_resid: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        cache_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        """Absorbed MLA's (query [T, H, r + rope], latent [T, 1, r + rope]), both in the cache dtype."""
        p, c = f"layers.{layer}.", self.config
        r, wdt = c.kv_lora_rank, h.dtype
        q_nope, q_pe = self.query(weights, layer, h, q_resid).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = F.linear(h, weights[p + "wkv_a"]).float().split([r, c.qk_rope_head_dim], dim=-1)
        c_kv = rms_norm(c_kv, weights[p + "kv_a_norm"], LATENT_NORM_EPS)
        q_pe = apply_rope(q_pe, cos, sin, c.rope.interleave)
        k_pe = apply_rope(k_pe[:, None, :], cos, sin, c.rope.interleave)
        latent = torch.cat([c_kv[:, None, :], k_pe], dim=-1).to(cache_dtype)  # [T, 1, r + rope]
        # q_nope . (W_UK c_kv) == (q_nope W_UK) . c_kv: the keys never leave the latent space.
        w_uk = self._w_kv_b(weights, layer)[:, : c.qk_nope_head_dim]
        q_latent = torch.bmm(q_nope.transpose(0, 1).to(wdt), w_uk).float().transpose(0, 1)  # [T, H, r]
        return torch.cat([q_latent, q_pe], dim=-1).to(cache_dtype), latent

    def _w_kv_b(self, weights: dict[str, Tensor], layer: int) -> Tensor:
        """kv_b_proj rows per head: k_nope [nope] then v [v_head_dim], each over the latent r."""
        c = self.config
        return weights[f"layers.{layer}.wkv_b"].view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)

    def latent_output(self, weights: dict[str, Tensor], layer: int, attn: Tensor, wdt: torch.dtype) -> Tensor:
        """Attention over the latent [T, H, r + rope] -> the layer's output [T, hidden] fp32."""
        c = self.config
        w_uv = self._w_kv_b(weights, layer)[:, c.qk_nope_head_dim :]
        # softmax . latent's first r dims is softmax . c_kv; W_UV lifts it into each head's values.
        values = torch.bmm(attn[..., : c.kv_lora_rank].transpose(0, 1).to(wdt), w_uv.transpose(1, 2))  # [H, T, v]
        out = values.transpose(0, 1).reshape(-1, c.num_heads * c.v_head_dim)
        return F.linear(out, weights[f"layers.{layer}.wo"]).float()

    def attention(
        self,
        weights: dict[str, Tensor],
        layer: int,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Tensor,
        paged: Paged,
    ) -> Tensor:
        """Absorbed MLA: h [T, hidden] in the core dtype -> attention output [T, hidden] fp32."""
        slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
        query, latent = self.latent_inputs(weights, layer, h, self.q_resid(weights, layer, h), cos, sin, cache.dtype)
        # One tensor as keys and values: written once per token (twice through the pair-writing op).
        torch.ops.flare.write_kv(cache, cache, latent, latent, slot_mapping)
        attn = torch.ops.flare.paged_attention(
            query, cache, cache, block_tables, seq_lens, query_start_loc, positions, self.config.softmax_scale
        )
        return self.latent_output(weights, layer, attn, h.dtype)

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        c = self.config
        if c.is_moe(layer):
            return moe.sparse_moe(c.moe_block, weights, layer, h)
        return swiglu(weights, f"layers.{layer}.", h).float()

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Vision cores: the image rows' input embeddings are the features."""
        c = self.config
        wdt = weights["embed"].dtype
        # As in the other families: residual stream, norms and rotary in fp32, matmuls in the core dtype.
        x = embed_images(self.embed_tokens(weights, s.token_ids), s)
        cos, sin = self.rotary(s.positions)
        x = self.decoder(weights, kv_cache, x, cos, sin, s.paged)
        hidden = rms_norm(x, weights["norm"], c.rms_norm_eps)
        outputs = self.outputs(hidden.to(wdt), weights, s)
        # With MTP layers the drafter's input too (glm5_next's config, built on this one, has no such field).
        return (*outputs, hidden) if c.num_mtp_layers else outputs

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, rope / 2] fp32, YaRN's attention factor included."""
        rope = self.config.rope
        freqs = positions.float()[:, None] * rope_inv_freq(rope, positions)[None, :]
        return (freqs.cos() * rope.cos_sin_scale)[:, None, :], (freqs.sin() * rope.cos_sin_scale)[:, None, :]

    def decoder(
        self,
        weights: dict[str, Tensor],
        kv_cache: list[Tensor],
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        paged: Paged,
    ) -> Tensor:
        """The residual stream x [T, hidden] fp32 through every layer (pre-norm attention, then MLP).
        On tp ranks (ignition.parallel_rules: each rank its query heads over the whole latent, its share
        of the MLP widths or experts) the row-parallel o and down projections' partial sums meet here."""
        c, wdt = self.config, weights["embed"].dtype
        attend = self.attender(weights, kv_cache, (cos, sin), paged)
        for i in range(c.num_layers):
            h = rms_norm(x, weights[f"layers.{i}.attn_norm"], c.rms_norm_eps).to(wdt)
            x = x + self.reduce(attend(i, h))
            h = rms_norm(x, weights[f"layers.{i}.mlp_norm"], c.rms_norm_eps).to(wdt)
            x = x + self.reduce(self.mlp(weights, i, h).float())
        return x

    def attender(self, weights: dict[str, Tensor], kv_cache: list[Tensor], rotary: Rotary, paged: Paged) -> Attend:
        """One step's per-layer attention for `decoder`: absorbed MLA over each layer's latent cache.
        A family whose layers hand state down (GLM's indexer selection) keeps it in the function."""
        cos, sin = rotary
        return lambda i, h: self.attention(weights, i, h, cos, sin, kv_cache[i], paged)


class MtpProgram(mtp.DraftForward, StepProgram):
    """MTP layer `layer`'s draft step (ignition.models.mtp's contract); its hidden states are
    shared_head.norm's output. The main step's attention, MLP and rotary are inherited."""

    def __init__(self, config: DeepseekV3Config, layer: int, num_top: int) -> None:
        super().__init__(config, num_top, explicit_ids=False, scored=False)
        self.layer = layer

    def draft(self, weights: dict[str, Tensor], kv_cache: list[Tensor], d: mtp.DraftInputs) -> tuple[Tensor, ...]:
        c = self.config
        index = c.num_layers + self.layer  # its checkpoint layer number, and its cache's (extra_caches)
        p, wdt, eps = f"layers.{index}.", weights["embed"].dtype, c.rms_norm_eps
        embed = weights[p + "embed"] if p + "embed" in weights else weights["embed"]
        joined = torch.cat(
            [
                rms_norm(F.embedding(d.token_ids, embed).float(), weights[p + "enorm"], eps),
                rms_norm(d.hidden.float(), weights[p + "hnorm"], eps),
            ],
            dim=-1,
        )
        x = F.linear(joined.to(wdt), weights[p + "eh_proj"]).float()
        cos, sin = self.rotary(d.paged.positions)
        h = rms_norm(x, weights[p + "attn_norm"], eps).to(wdt)
        x = x + self.attention(weights, index, h, cos, sin, kv_cache[index], d.paged)
        h = rms_norm(x, weights[p + "mlp_norm"], eps).to(wdt)
        x = x + self.mlp(weights, index, h).float()
        out = rms_norm(x, weights[p + "head_norm"], eps)
        if p + "head" in weights:
            head = weights[p + "head"]
        else:
            head = weights["embed"] if c.tie_word_embeddings else weights["lm_head"]
        return self.draft_outputs(out, head, d, wdt)


def duplicates(config: DeepseekV3Config) -> dict[str, str]:
    """The MTP layers' own embedding and head -> the main ones they may copy (DeepSeek-V3's release
    stores both twice): export keeps an exact copy once, and MtpProgram then reads the main one."""
    head = "embed" if config.tie_word_embeddings else "lm_head"
    return {
        name: original
        for k in range(config.num_mtp_layers)
        for name, original in (
            (f"layers.{config.num_layers + k}.embed", "embed"),
            (f"layers.{config.num_layers + k}.head", head),
        )
    }


def extra_programs(config: DeepseekV3Config, num_top: int, weights: dict[str, Tensor]) -> tuple[mtp.ExtraProgram, ...]:
    """One mtp_draft.N program per MTP layer, checked at export against reference_mtp."""
    n = config.num_layers
    mtp.require_layers(
        weights, config.num_mtp_layers, lambda k: f"layers.{n + k}.eh_proj", lambda k: f"model.layers.{n + k}."
    )
    return mtp.checked_drafts(config, num_top, MtpProgram, reference_forward, reference_mtp)


# ---------------------------------------------------------------------- plain reference


def reference_angles(spec: RopeSpec, total: int) -> Tensor:
    """[T, dim / 2] float64 rotary angles, YaRN computed in plain Python floats."""
    pairs = spec.dim // 2
    inv = [spec.theta ** (-2 * j / spec.dim) for j in range(pairs)]
    if spec.yarn:
        low, high = spec.correction_range()
        keep = [1 - min(max((j - low) / (high - low), 0.0), 1.0) for j in range(pairs)]  # 1: extrapolate
        inv = [f / spec.factor * (1 - k) + f * k for f, k in zip(inv, keep)]
    return torch.arange(total, dtype=torch.float64)[:, None] * torch.tensor(inv, dtype=torch.float64)[None, :]


def reference_rotate(t: Tensor, angles: Tensor, scale: float, interleave: bool) -> Tensor:
    """t [heads, T, D] rotated as complex pairs (DeepSeek's own view_as_complex formulation);
    interleaved pairs stay interleaved, which q.k does not notice."""
    rot = torch.polar(torch.full_like(angles, scale), angles).to(torch.complex64)  # [T, D/2]
    if interleave:
        pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rot).flatten(-2)
    half = t.shape[-1] // 2
    z = torch.complex(t[..., :half], t[..., half:]) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def reference_norm(t: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps))


def reference_q_resid(c: DeepseekV3Config, w: dict[str, Tensor], prefix: str, h: Tensor) -> Tensor | None:
    """The normed q LoRA down-projection [T, q_lora_rank] of the attention block under `prefix`."""
    if c.q_lora_rank is None:
        return None
    return reference_norm(h @ w[prefix + "q_a_proj.weight"].T, w[prefix + "q_a_layernorm.weight"], LATENT_NORM_EPS)


def reference_mla(
    c: DeepseekV3Config, w: dict[str, Tensor], prefix: str, h: Tensor, rotate: Callable[[Tensor], Tensor], mask: Tensor
) -> Tensor:
    """Non-absorbed MLA of the block under `prefix` ("model.layers.N.self_attn."): h [T, hidden]
    -> o_proj output [T, hidden], with an additive mask [T, T] (0 or -inf)."""
    total, heads = h.shape[0], c.num_heads
    q_resid = reference_q_resid(c, w, prefix, h)
    q = h @ w[prefix + "q_proj.weight"].T if q_resid is None else q_resid @ w[prefix + "q_b_proj.weight"].T
    q = q.view(total, heads, c.qk_head_dim).transpose(0, 1)  # [H, T, qk]
    q_nope, q_pe = q[..., : c.qk_nope_head_dim], rotate(q[..., c.qk_nope_head_dim :])
    kv = h @ w[prefix + "kv_a_proj_with_mqa.weight"].T
    c_kv = reference_norm(kv[:, : c.kv_lora_rank], w[prefix + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
    k_pe = rotate(kv[None, :, c.kv_lora_rank :])  # [1, T, rope], shared by every head
    expanded = (c_kv @ w[prefix + "kv_b_proj.weight"].T).view(total, heads, -1).transpose(0, 1)
    k_nope, v = expanded[..., : c.qk_nope_head_dim], expanded[..., c.qk_nope_head_dim :]
    k = torch.cat([k_nope, k_pe.expand(heads, -1, -1)], dim=-1)
    scores = torch.cat([q_nope, q_pe], dim=-1) @ k.transpose(1, 2) * c.softmax_scale + mask
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(total, -1)
    return attn @ w[prefix + "o_proj.weight"].T


def _reference_layer(
    c: DeepseekV3Config, w: dict[str, Tensor], layer: int, x: Tensor, rotate: Callable[[Tensor], Tensor], mask: Tensor
) -> Tensor:
    """Decoder layer `layer` (checkpoint numbering; MTP layers' too) over the residual stream x [T, hidden]."""
    p = f"model.layers.{layer}."
    h = reference_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
    x = x + reference_mla(c, w, p + "self_attn.", h, rotate, mask)
    h = reference_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
    if c.is_moe(layer):
        return x + moe.reference_moe(c.moe_block, w, p + "mlp.", h)
    return x + reference_swiglu(w, p + "mlp.", h)


def _reference_setup(c: DeepseekV3Config, hf_weights: dict[str, Tensor], total: int):
    """(fp32 weights under DeepseekV3ForCausalLM names, complex rotary over T positions, causal mask [T, T])."""
    w = {canonical_name(k): v.float() for k, v in hf_weights.items()}
    angles = reference_angles(c.rope, total)

    def rotate(t: Tensor) -> Tensor:
        return reference_rotate(t, angles, c.rope.cos_sin_scale, c.rope.interleave)

    return w, rotate, torch.full((total, total), float("-inf")).triu(1)


def _reference_head(c: DeepseekV3Config, w: dict[str, Tensor], x: Tensor, own: str | None = None) -> Tensor:
    if own is not None and own in w:
        return x @ w[own].T
    return x @ (w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]).T


def reference_forward(
    config: DeepseekV3Config, hf_weights: dict[str, Tensor], token_ids: list[int], images: PromptImages | None = None
) -> tuple[Tensor, Tensor]:
    """Dense, unpaged forward over Hugging Face-named weights: (logits [T, V], final-normed hidden
    states [T, hidden]), fp32, with the prompt's `images` spliced in.

    Non-absorbed MLA on purpose (kv_b_proj expands every head's k_nope and v from c_kv,
    explicit causal mask, complex-number rotary), so the export self-check compares two
    formulations of the same attention.
    """
    c = config
    w, rotate, mask = _reference_setup(c, hf_weights, len(token_ids))
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    if images is not None:
        images.splice(x)
    for i in range(c.num_layers):
        x = _reference_layer(c, w, i, x, rotate, mask)
    x = reference_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    return _reference_head(c, w, x), x


reference_logits = mtp.logits_of(reference_forward)


def reference_mtp(
    config: DeepseekV3Config, hf_weights: dict[str, Tensor], layer: int, next_ids: list[int], hidden: Tensor
) -> tuple[Tensor, Tensor]:
    """MTP layer `layer` over a whole sequence, fp32: row t joins next_ids[t] (the token after
    position t) with hidden[t] (the main model's final-normed hidden state at t), causally over
    rows <= t. Returns (logits [T, V]: the token after next_ids[t], MTP hidden states [T, hidden],
    shared_head.norm's output)."""
    c = config
    index = c.num_layers + layer
    m = f"model.layers.{index}."
    w, rotate, mask = _reference_setup(c, hf_weights, len(next_ids))
    embed = w.get(m + "embed_tokens.weight", w["model.embed_tokens.weight"])
    joined = torch.cat(
        [
            reference_norm(embed[torch.tensor(next_ids)], w[m + "enorm.weight"], c.rms_norm_eps),
            reference_norm(hidden.float(), w[m + "hnorm.weight"], c.rms_norm_eps),
        ],
        dim=-1,
    )
    x = _reference_layer(c, w, index, joined @ w[m + "eh_proj.weight"].T, rotate, mask)
    x = reference_norm(x, w[m + "shared_head.norm.weight"], c.rms_norm_eps)
    return _reference_head(c, w, x, m + "shared_head.head.weight"), x


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Kimi K3's special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "kimi3"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny DeepSeek-V3 config: 3 layers (the first dense), 8 sigmoid-routed experts top-2 in
    2 groups (1 kept), a shared expert, q LoRA, interleaved plain rotary."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_interleave": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _text_shapes(c: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes (per-expert layout) of the text model of a checkpoint with
    this config (hf_shapes nests them as Kimi_K25ForConditionalGeneration does for a multimodal one)."""
    h, heads = c.hidden_size, c.num_heads
    attention: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.kv_a_proj_with_mqa.weight": (c.latent_dim, h),
        "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        "self_attn.o_proj.weight": (h, heads * c.v_head_dim),
    }
    if c.q_lora_rank is None:
        attention["self_attn.q_proj.weight"] = (heads * c.qk_head_dim, h)
    else:
        attention.update(
            {
                "self_attn.q_a_proj.weight": (c.q_lora_rank, h),
                "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
                "self_attn.q_b_proj.weight": (heads * c.qk_head_dim, c.q_lora_rank),
            }
        )
    shapes = decoder_shapes(c, attention)
    num_mtp = c.num_mtp_layers
    for layer in range(c.num_layers, c.num_layers + num_mtp):
        p = f"model.layers.{layer}."
        shapes.update({p + name: shape for name, shape in attention.items()})
        shapes.update(
            {
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "eh_proj.weight": (h, 2 * h),
                p + "shared_head.norm.weight": (h,),
                p + "shared_head.head.weight": (c.vocab_size, h),
                p + "embed_tokens.weight": (c.vocab_size, h),
            }
        )
    f, s = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
    for layer in range(c.num_layers + num_mtp):
        p = f"model.layers.{layer}.mlp."
        if not c.is_moe(layer):
            shapes.update(swiglu_shapes(p, h, c.intermediate_size))
            continue
        e = c.router.num_experts
        shapes.update({p + "gate.weight": (e, h), p + "gate.e_score_correction_bias": (e,)})
        shapes.update(moe.expert_shapes(p, e, h, f))
        if s:
            shapes.update(swiglu_shapes(p + "shared_experts.", h, s))
    return shapes


hf_shapes = vision_hooks.nested_shapes(_text_shapes, kimi_k25_vision)


# The multimodal test checkpoint (ignition.testmodel --vision).
TINY_VISION = TinyVision(testmodel_vision, "kimi_k3-vision", TESTMODEL_VISION_TOKENS, TESTMODEL_PROCESSOR)

# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    deepseek_v3_config,
    sys.modules[__name__],
    reference=Reference(reference_logits, features=vision_hooks.reference_features(kimi_k25_vision)),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, vision=TINY_VISION),
    vision=vision_hooks.of(kimi_k25_vision),
)
