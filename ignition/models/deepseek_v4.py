"""The deepseek_v4 family (DeepseekV4ForCausalLM: DeepSeek-V4 Flash/Pro text, V4.1).

Per layer one of three attention types over ONE shared key=value head (MQA, K = V), each with a
sliding window over the raw rows and a learned per-head sink:
- sliding_attention: the window only (plain rotary, `rope_theta`);
- heavily_compressed_attention (HCA): plus every compressed entry so far, one per `rate` tokens
  (a softmax-gated pool of the group's own kv projection, normed and rotated at the group start);
- compressed_sparse_attention (CSA): entries pooled over two groups (the previous one's first
  half-channels with this one's second), of which a Lightning indexer keeps the top-k per query.
Compressed layers rotate with the `compress` rotary (compress_rope_theta, optionally YaRN).
The query is a LoRA (q_a -> norm -> q_b) with a weightless per-head norm; the attention output
is rotated back at the query position, then projected per head group (o_a) and mixed (o_b).
Around every block, hyper-connections: `hc_mult` residual streams, collapsed into the block's
input and expanded from its output with Sinkhorn-normalized mixing; a HyperHead collapses them
at the end. MLPs: routed experts (sqrt-softplus scores, top-k with a correction bias; the first
`hash_moe` layers pick experts by token id) with clamped SwiGLU, plus one shared expert.

Caches (all per position, paged like the KV pages so prefix reuse stays exact; KvLayout.shared_kv
plus KvLayout.extra): every layer keeps its raw rows (one [D] tensor per layer); a
compressed layer also keeps per position the compressor's inputs [kv | gate + position bias]
(its "state": a group straddling steps or a reused prefix is pooled from it) and, at the slot of
the position completing group e, entry e; CSA layers keep the same two for the indexer's keys.
Checked against transformers 5.24 `DeepseekV4ForCausalLM` (models/deepseek_v4).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops.deepseek_v4  # noqa: F401  (defines the flare::dsv4_* ops the program calls)
from ignition.models import deepseek_v4_config, moe
from ignition.models.common import hyper_block, hyper_residual, rms_norm, unit_rms
from ignition.models.deepseek_v3 import rope_inv_freq
from ignition.models.deepseek_v3_config import RopeSpec
from ignition.models.deepseek_v4_config import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config, extra_caches
from ignition.models.deepseek_v4_reference import reference_logits
from ignition.models.family import Family, Reference, TinyCheckpoint
from ignition.models.step import Paged, StepInputs, StepModule

# ---------------------------------------------------------------------------- step program


def rope_cos_sin(spec: RopeSpec, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 1, dim / 2] fp32 of the rotary at `positions` (cos/sin scaled as YaRN says)."""
    freqs = positions.float()[:, None] * rope_inv_freq(spec, positions)[None, :]
    scale = spec.cos_sin_scale
    return (freqs.cos() * scale)[:, None, :], (freqs.sin() * scale)[:, None, :]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved rotary on the trailing 2 * cos.shape[-1] channels of x [T, heads, D]; pairs stay
    interleaved (keys are also values here, so the layout is the output's)."""
    dim = 2 * cos.shape[-1]
    head, tail = x[..., : x.shape[-1] - dim], x[..., x.shape[-1] - dim :]
    a, b = tail[..., 0::2], tail[..., 1::2]
    return torch.cat([head, torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)], dim=-1)


class StepProgram(StepModule):
    """The step over kv_cache = [rows_0, ..., rows_{L-1}] ([pages, page_tokens, 1, head_dim]) then
    extra_caches(config) (KvLayout.extra)."""

    def __init__(self, config: DeepseekV4Config, num_top: int, explicit_ids: bool, scored: bool) -> None:
        super().__init__(config, num_top, explicit_ids, scored)
        self.extra_names = tuple(e[0] for e in extra_caches(config))

    def compress(
        self,
        weights: dict[str, Tensor],
        layer: int,
        part: str,
        h: Tensor,
        state: Tensor,
        entries: Tensor,
        paged: Paged,
    ) -> None:
        """Store this step's compressor state, then pool, norm and rotate every group it completes into
        `entries` at the completing position's slot (part: "comp" or "index")."""
        c, p = self.config, f"layers.{layer}.{part}."
        rate, positions = c.layer_rates[layer], paged.positions
        kv, gate = F.linear(h, weights[p + "w_kv_gate"]).float().chunk(2, dim=-1)
        gate = gate + weights[p + "bias"].float()[positions % rate]
        row = torch.cat([kv, gate], dim=-1)[:, None, :].to(state.dtype)
        torch.ops.flare.write_kv(state, state, row, row, paged.slot_mapping)
        pooled = torch.ops.flare.dsv4_pool(
            state, paged.block_tables, paged.query_start_loc, positions, rate, c.is_csa(layer)
        )
        cos, sin = rope_cos_sin(c.compress_rope, positions + 1 - rate)  # entry e sits at position e * rate
        entry = rotate(rms_norm(pooled, weights[p + "norm"].float(), c.rms_norm_eps)[:, None, :], cos, sin)
        entry = entry.to(entries.dtype)
        done = (positions + 1) % rate == 0
        torch.ops.flare.write_kv(entries, entries, entry, entry, torch.where(done, paged.slot_mapping, -1))

    def attention(
        self,
        weights: dict[str, Tensor],
        layer: int,
        h: Tensor,
        ropes: dict[str, tuple[Tensor, Tensor]],
        caches: dict[str, Tensor],
        paged: Paged,
    ) -> Tensor:
        """h [T, hidden] in the core dtype -> attention output [T, hidden] fp32."""
        c, p, wdt = self.config, f"layers.{layer}.", h.dtype
        cos, sin = ropes["compress" if c.is_compressed(layer) else "main"]
        rows = caches[f"{p}rows"]
        q_res = rms_norm(F.linear(h, weights[p + "wq_a"]).float(), weights[p + "q_a_norm"].float(), c.rms_norm_eps)
        q = F.linear(q_res.to(wdt), weights[p + "wq_b"]).float().view(-1, c.num_heads, c.head_dim)
        q = rotate(unit_rms(q, c.rms_norm_eps), cos, sin)
        kv = rms_norm(F.linear(h, weights[p + "wkv"]).float(), weights[p + "kv_norm"].float(), c.rms_norm_eps)
        kv = rotate(kv[:, None, :], cos, sin).to(rows.dtype)
        torch.ops.flare.write_kv(rows, rows, kv, kv, paged.slot_mapping)
        entries = selected = None
        if c.is_compressed(layer):
            entries = caches[f"{p}compressed_kv"]
            self.compress(weights, layer, "comp", h, caches[f"{p}compressor_state"], entries, paged)
        if c.is_csa(layer):
            keys = caches[f"{p}indexer_keys"]
            self.compress(weights, layer, "index", h, caches[f"{p}indexer_state"], keys, paged)
            iq = F.linear(q_res.to(wdt), weights[p + "index.wq_b"]).float().view(-1, c.index_n_heads, c.index_head_dim)
            iq = rotate(iq, cos, sin)
            head_weights = F.linear(h, weights[p + "index.w_heads"]).float() * c.index_n_heads**-0.5
            selected = torch.ops.flare.dsv4_indexer_topk(
                iq,
                head_weights,
                keys,
                paged.block_tables,
                paged.query_start_loc,
                paged.positions,
                c.layer_rates[layer],
                c.index_topk,
                c.index_head_dim**-0.5,
            )
        attn = torch.ops.flare.dsv4_attention(
            q.to(rows.dtype),
            rows,
            entries,
            paged.block_tables,
            paged.query_start_loc,
            paged.positions,
            weights[p + "sinks"].float(),
            c.head_dim**-0.5,
            c.sliding_window,
            c.layer_rates[layer],
            selected,
        )
        attn = rotate(attn.float(), cos, -sin)  # the values' rotation, undone at the query's position
        groups = attn.reshape(-1, c.o_groups, c.num_heads * c.head_dim // c.o_groups).transpose(0, 1)
        w_a = weights[p + "wo_a"].view(c.o_groups, c.o_lora_rank, -1)
        grouped = torch.bmm(groups.to(wdt), w_a.transpose(1, 2)).transpose(0, 1).reshape(-1, c.o_groups * c.o_lora_rank)
        # on tp ranks each rank holds its query heads' output groups (row-parallel o_b): the sums meet here
        return self.reduce(F.linear(grouped, weights[p + "wo_b"]).float())

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor, token_ids: Tensor) -> Tensor:
        c, p = self.config, f"layers.{layer}."
        logits = F.linear(h.float(), weights[p + "w_router"].float())
        if c.hash_layers[layer]:  # experts fixed by the token id, weighted by the learned scores
            ids = weights[p + "tid2eid"][token_ids].long()
            top = moe.weights_at(c.router, moe.scores(c.router, logits), ids)
        else:
            top, ids = moe.route(c.router, logits, weights[p + "router_bias"])
        experts_gate_up, experts_down = weights[p + "w_experts_gate_up"], weights[p + "w_experts_down"]
        if "expert_start" in weights:  # an expert-parallel rank: its experts' part of the routed sum
            top, ids = moe.local_experts(top, ids, weights["expert_start"], experts_gate_up.shape[0])
        out = moe.routed_mlp(h, top, ids, experts_gate_up, experts_down, c.activation)
        out = out + moe.shared_mlp(h, weights[p + "w_shared_gate_up"], weights[p + "w_shared_down"], c.activation)
        return self.reduce(out)  # tp ranks: their shares of the widths (or experts) added

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        c = self.config
        wdt = weights["embed"].dtype
        caches = {f"layers.{i}.rows": kv_cache[i] for i in range(c.num_layers)}
        caches.update(zip(self.extra_names, kv_cache[c.num_layers :], strict=True))
        positions = s.positions
        ropes = {"main": rope_cos_sin(c.main_rope, positions), "compress": rope_cos_sin(c.compress_rope, positions)}
        # The hc_mult residual streams, norms and mixing stay fp32; matmuls run in the core dtype.
        streams = self.embed_tokens(weights, s.token_ids)[:, None, :].expand(-1, c.hc_mult, -1)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            post, comb, collapsed = hyper_block(c, weights, p + "attn_hc.", streams)
            h = rms_norm(collapsed, weights[p + "attn_norm"].float(), c.rms_norm_eps).to(wdt)
            out = self.attention(weights, i, h, ropes, caches, s.paged)
            streams = hyper_residual(post, comb, out, streams)
            post, comb, collapsed = hyper_block(c, weights, p + "ffn_hc.", streams)
            h = rms_norm(collapsed, weights[p + "mlp_norm"].float(), c.rms_norm_eps).to(wdt)
            out = self.mlp(weights, i, h, s.token_ids)
            streams = hyper_residual(post, comb, out, streams)
        mixes = F.linear(unit_rms(streams.flatten(1), c.rms_norm_eps), weights["hc_head.fn"].float())
        pre = torch.sigmoid(mixes * weights["hc_head.scale"].float() + weights["hc_head.base"].float()) + c.hc_eps
        x = rms_norm((pre[:, :, None] * streams).sum(dim=1), weights["norm"].float(), c.rms_norm_eps).to(wdt)
        return self.outputs(x, weights, s)


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry DeepSeek V4's special tokens; their chats lower through the native encoder.
TEST_CHAT: str | None = "deepseek"
_TEST_EXPERTS = 8


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny V4: all three attention types (window 8 < 16-token pages; CSA groups of 4 with an
    indexer keeping 3; HCA groups of 12, which straddle pages and 16-token chunks), two hash-routed
    layers then top-k routed ones, 4 hyper-connection streams, grouped output projection.

    The indexer has 32 heads because candidates tied at a zero score (every head's ReLU zero, likely
    with few heads) make the top-k pick arbitrary, in transformers as anywhere."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "q_lora_rank": 48,
        "partial_rotary_factor": 0.25,  # an 8-dim rotary
        "layer_types": [HCA, CSA, SLIDING, CSA],
        "compress_rates": {CSA: 4, HCA: 12},
        "mlp_layer_types": [HASH_MOE, HASH_MOE, MOE, MOE],
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 32,  # a candidate scores exactly 0 only when every head's ReLU is 0: never, here
        "index_head_dim": 16,
        "index_topk": 3,
        "n_routed_experts": _TEST_EXPERTS,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 2.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def hf_shapes(c: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes (transformers 5's stacked experts) of a checkpoint with this config."""
    h, hc, e, f = c.hidden_size, c.hc_mult, c.router.num_experts, c.moe_intermediate_size
    mixes = (2 + hc) * hc
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        a = f"model.layers.{i}.self_attn."
        shapes.update(
            {
                a + "sinks": (c.num_heads,),
                a + "q_a_proj.weight": (c.q_lora_rank, h),
                a + "q_a_norm.weight": (c.q_lora_rank,),
                a + "q_b_proj.weight": (c.num_heads * c.head_dim, c.q_lora_rank),
                a + "kv_proj.weight": (c.head_dim, h),
                a + "kv_norm.weight": (c.head_dim,),
                a + "o_a_proj.weight": (c.o_groups * c.o_lora_rank, c.num_heads * c.head_dim // c.o_groups),
                a + "o_b_proj.weight": (h, c.o_groups * c.o_lora_rank),
            }
        )
        if c.is_compressed(i):
            width = c.state_dim(i) // 2
            shapes.update(
                {
                    a + "compressor.position_bias": (c.layer_rates[i], width),
                    a + "compressor.kv_proj.weight": (width, h),
                    a + "compressor.gate_proj.weight": (width, h),
                    a + "compressor.kv_norm.weight": (c.head_dim,),
                }
            )
        if c.is_csa(i):
            x, width = a + "compressor.indexer.", c.state_dim(i, indexer=True) // 2
            shapes.update(
                {
                    x + "position_bias": (c.layer_rates[i], width),
                    x + "kv_proj.weight": (width, h),
                    x + "gate_proj.weight": (width, h),
                    x + "kv_norm.weight": (c.index_head_dim,),
                    x + "q_b_proj.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                    x + "scorer.weights_proj.weight": (c.index_n_heads, h),
                }
            )
        m = f"model.layers.{i}.mlp."
        shapes[m + "gate.weight"] = (e, h)
        shapes[m + ("gate.tid2eid" if c.hash_layers[i] else "gate.e_score_correction_bias")] = (
            (c.vocab_size, c.router.top_k) if c.hash_layers[i] else (e,)
        )
        shapes.update(
            {
                m + "experts.gate_up_proj": (e, 2 * f, h),
                m + "experts.down_proj": (e, h, f),
                m + "shared_experts.gate_proj.weight": (f, h),
                m + "shared_experts.up_proj.weight": (f, h),
                m + "shared_experts.down_proj.weight": (h, f),
            }
        )
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        for block in ("attn_hc.", "ffn_hc."):
            shapes.update({p + block + "fn": (mixes, hc * h), p + block + "base": (mixes,), p + block + "scale": (3,)})
    shapes.update(
        {
            "model.norm.weight": (h,),
            "model.hc_head.hc_fn": (hc, hc * h),
            "model.hc_head.hc_base": (hc,),
            "model.hc_head.hc_scale": (1,),
        }
    )
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def testmodel_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Tensor | None:
    """Hash layers' token -> expert table: distinct experts per token (the generic init is for floats)."""
    if not name.endswith(".tid2eid"):
        return None
    vocab, top_k = shape
    experts = _TEST_EXPERTS
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(vocab)])


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    deepseek_v4_config,
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, init=testmodel_init),
)
