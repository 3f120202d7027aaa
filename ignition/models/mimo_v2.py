"""The MiMo-V2 family (Xiaomi MiMo-V2-Flash, MiMoV2FlashForCausalLM): config, weight maps, step programs, reference.

As transformers 5.24's modeling_mimo_v2_flash computes it:
- Layers of two kinds (`layer_types`): full attention over `num_key_value_heads` kv heads, and
  sliding-window attention over twice as many kv heads, with learned per-head sink logits
  (`self_attn.sinks`, the hub's `attention_sink_bias`) that join each softmax and are dropped.
  The window is `sliding_window` keys including the query (hub configs give
  `sliding_window_size`, and transformers adds one): key j is visible at p iff p - window < j <= p.
- Queries and keys are `head_dim` wide, values `v_head_dim`; values are multiplied by
  `attention_value_scale` (0.707 by default; null = 1) before the cache; scores by head_dim**-0.5.
- Partial rotary per layer type (`rope_parameters`): the first 2 * ceil(d / 2) dims of q and k
  rotate (rotate-half), d = int(head_dim * partial_rotary_factor), inverse frequencies
  theta ** (-2j / d), each type its own theta.
- MLPs per `mlp_layer_types`: dense SwiGLU, or routed MoE without shared experts: sigmoid scores,
  e_score_correction_bias for selection only, group-limited top-k (n_group / topk_group),
  renormalized weights (+1e-20) times routed_scaling_factor (ignition.models.moe).
- Pre-norm RMSNorm blocks, a final norm, optionally tied embeddings.

The paged cache holds ONE tensor per layer (KvLayout.shared_kv) whose rows are each kv head's key
followed by its value ([.., kv_heads, head_dim + v_head_dim]); `flare::sink_attention`
(helios.core.ops_sinks) reads it, with the sinks on sliding layers. Full layers have half the kv
heads of the cache: they write zeros into the other half and attend over a view of their own.

Multi-token prediction (`num_nextn_predict_layers` layers under `model.mtp.layers.N.`, which
transformers does not load): DeepSeek-V3's design as MiMo's checkpoints and vLLM/SGLang spell it:
enorm(embedding of the next token) and hnorm(the main model's final-normed hidden state) are
concatenated, projected by eh_proj, run through one sliding-attention decoder layer (sinks, a
dense MLP of intermediate_size, its own KV on the step's pages: KvLayout.extra "mtp_kv"), normed
by final_layernorm and scored by the shared head. Each MTP layer is exported as its own program
"mtp_draft.N" (extra_programs), and the family's step programs then also return the final-normed
hidden states every row (output "hidden_states"), which the drafter takes. There is no
transformers reference for MTP: `reference_mtp` below is this family's own plain-torch one.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.manifest import TensorSpec
from ignition.models import mimo_v2_config, moe, mtp
from ignition.models.common import partial_rotary, rms_norm, rope, swiglu_shapes
from ignition.models.family import Family, Reference, TinyCheckpoint
from ignition.models.mimo_v2_config import FULL, SLIDING, MiMoV2Config, RopeSpec, window_pool
from ignition.models.step import Paged, StepInputs, StepModule

# ---------------------------------------------------------------------------- step program


def _attention(
    c: MiMoV2Config,
    weights: dict[str, Tensor],
    p: str,
    h: Tensor,
    window: int,
    rope: tuple[Tensor, Tensor],
    cache: Tensor,
    paged: Paged,
) -> Tensor:
    """h [T, hidden] in the core dtype -> the attention block's output [T, hidden] fp32; writes
    this step's packed rows into `cache` [P, S, cache_heads, head_dim + v_head_dim]."""
    slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
    heads, kvh, dk, dv = c.num_heads, c.kv_heads(window > 0), c.head_dim, c.v_head_dim
    sizes = [heads * dk, kvh * dk, kvh * dv]
    if p + "wqkv" in weights:
        q, k, v = F.linear(h, weights[p + "wqkv"]).float().split(sizes, dim=-1)
    else:  # the MTP layers are not fused
        q, k, v = (F.linear(h, weights[p + name]).float() for name in ("wq", "wk", "wv"))
    cos, sin = rope
    q = partial_rotary(q.reshape(-1, heads, dk), cos, sin)
    k = partial_rotary(k.reshape(-1, kvh, dk), cos, sin)
    v = v.reshape(-1, kvh, dv) * c.value_scale
    rows = torch.cat([k, v], dim=-1)  # [T, kvh, dk + dv]
    if kvh < cache.shape[2]:  # a full layer: the cache's other heads stay zero, and unread
        rows = F.pad(rows, (0, 0, 0, cache.shape[2] - kvh))
    kvt = cache.dtype
    rows = rows.to(kvt)
    torch.ops.flare.write_kv(cache, cache, rows, rows, slot_mapping)  # one tensor as keys and values
    own = cache if kvh == cache.shape[2] else cache[:, :, :kvh]
    sinks = weights[p + "sinks"].float() if window > 0 else None
    attn = torch.ops.flare.sink_attention(
        q.to(kvt), own, block_tables, seq_lens, query_start_loc, positions, dk**-0.5, window, sinks
    )
    return F.linear(attn.reshape(-1, heads * dv).to(h.dtype), weights[p + "wo"]).float()


def _dense_mlp(weights: dict[str, Tensor], p: str, h: Tensor) -> Tensor:
    if p + "w_gate_up" in weights:
        gate, up = F.linear(h, weights[p + "w_gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, weights[p + "w_gate"]), F.linear(h, weights[p + "w_up"])
    return F.linear(F.silu(gate) * up, weights[p + "w_down"]).float()


def _ropes(c: MiMoV2Config, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
    """cos/sin per layer kind (True: sliding), for the kinds present (MTP layers slide)."""
    kinds = {w > 0 for w in c.layer_windows} | ({True} if c.num_mtp_layers else set())
    specs = {True: c.rope_sliding, False: c.rope_full}
    return {s: rope(positions, specs[s].dim, specs[s].theta) for s in kinds}


class StepProgram(StepModule):
    """The step over kv_cache = [packed_0, ..., packed_{L-1}, then the MTP layers' (untouched here)];
    with MTP layers, one more output after the signature's: hidden_states [T, hidden] fp32, the
    final-normed hidden state of every row (what mtp_draft.N takes)."""

    def windowed(self) -> bool:
        return window_pool(self.config) is not None

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Sliding layers' caches are in the window pool (window_pool), with its own slots and tables."""
        c = self.config
        # As in the other families: weights and matmul inputs in the core's dtype; residual stream,
        # norms, rotary and router in fp32.
        wdt = weights["embed"].dtype
        x = F.embedding(s.token_ids, weights["embed"]).float()
        ropes = _ropes(c, s.positions)
        for i, window in enumerate(c.layer_windows):
            p = f"layers.{i}."
            h = rms_norm(x, weights[p + "attn_norm"], c.rms_norm_eps).to(wdt)
            x = x + _attention(c, weights, p, h, window, ropes[window > 0], kv_cache[i], s.pages(window > 0))
            h = rms_norm(x, weights[p + "mlp_norm"], c.rms_norm_eps).to(wdt)
            x = (
                x
                + (
                    moe.sparse_moe(moe.MoeBlock(c.router), weights, i, h)
                    if c.layer_sparse[i]
                    else _dense_mlp(weights, p, h)
                ).float()
            )
        hidden = rms_norm(x, weights["norm"], c.rms_norm_eps)
        outputs = self.outputs(hidden.to(wdt), weights, s)
        return (*outputs, hidden) if c.num_mtp_layers else outputs


def extra_step_outputs(config: MiMoV2Config) -> tuple[TensorSpec, ...]:
    """Outputs the step programs return after program_signature's: the drafter's input, with MTP layers."""
    return mtp.extra_step_outputs(config.hidden_size, config.num_mtp_layers)


class MtpProgram(mtp.DraftModule):
    """One MTP layer's draft step (ignition.models.mtp's contract): predicts the token after
    token_ids[t]; its hidden states are final_layernorm's output."""

    def draft(self, weights: dict[str, Tensor], kv_cache: list[Tensor], d: mtp.DraftInputs) -> tuple[Tensor, ...]:
        c, p = self.config, f"mtp.{self.layer}."
        wdt, eps = weights["embed"].dtype, c.rms_norm_eps
        embedded = F.embedding(d.token_ids, weights["embed"]).float()
        joined = torch.cat(
            [rms_norm(embedded, weights[p + "enorm"], eps), rms_norm(d.hidden.float(), weights[p + "hnorm"], eps)],
            dim=-1,
        )
        x = F.linear(joined.to(wdt), weights[p + "eh_proj"]).float()
        cache = kv_cache[c.num_layers + self.layer]  # after the main layers' (extra_caches)
        h = rms_norm(x, weights[p + "attn_norm"], eps).to(wdt)
        x = x + _attention(
            c,
            weights,
            p,
            h,
            c.sliding_window,
            rope(d.paged.positions, c.rope_sliding.dim, c.rope_sliding.theta),
            cache,
            d.paged,
        )
        h = rms_norm(x, weights[p + "mlp_norm"], eps).to(wdt)
        x = x + _dense_mlp(weights, p, h)
        out = rms_norm(x, weights[p + "final_norm"], eps)
        head = weights["embed"] if c.tie_word_embeddings else weights["lm_head"]
        return self.draft_outputs(out, head, d, wdt)


def extra_programs(config: MiMoV2Config, num_top: int, weights: dict[str, Tensor]) -> tuple[mtp.ExtraProgram, ...]:
    """One mtp_draft.N program per MTP layer, checked at export against reference_mtp."""
    mtp.require_layers(weights, config.num_mtp_layers, lambda k: f"mtp.{k}.eh_proj", lambda k: f"model.mtp.layers.{k}.")
    return mtp.checked_drafts(config, num_top, MtpProgram, reference_forward, reference_mtp)


# ---------------------------------------------------------------------- plain reference


class _Float64View:
    """HF-named weights as float64 on access (nothing kept), under canonical names: transformers'
    `self_attn.sinks` for the hub's `attention_sink_bias`, post_attention_layernorm for the MTP
    layers' pre_mlp_layernorm."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        self._weights = weights
        self._names = {_canonical(name): name for name in weights}

    def __getitem__(self, name: str) -> Tensor:
        return self._weights[self._names[name]].to(torch.float64)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def _canonical(name: str) -> str:
    name = name.replace("self_attn.attention_sink_bias", "self_attn.sinks")
    return name.replace(".pre_mlp_layernorm.", ".post_attention_layernorm.") if name.startswith("model.mtp.") else name


def _ref_norm(t: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps))


def _ref_rotate(t: Tensor, spec: RopeSpec) -> Tensor:
    """t [heads, T, D] float64: pairs (j, j + pairs) of the first 2 * pairs dims turned as complex numbers."""
    pairs = spec.pairs
    inv = torch.tensor([spec.theta ** (-2 * j / spec.dim) for j in range(pairs)], dtype=torch.float64)
    angles = torch.arange(t.shape[1], dtype=torch.float64)[:, None] * inv[None, :]
    z = torch.complex(t[..., :pairs], t[..., pairs : 2 * pairs]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag, t[..., 2 * pairs :]], dim=-1)


def _ref_attention(c: MiMoV2Config, w: _Float64View, a: str, h: Tensor, window: int) -> Tensor:
    """The attention block under `a` ("...self_attn."), h [T, hidden] float64 -> [T, hidden]:
    explicit scores, an explicit (windowed) causal mask and, on sliding layers, the sink column."""
    total, heads, kvh = h.shape[0], c.num_heads, c.kv_heads(window > 0)
    spec = c.rope_sliding if window else c.rope_full
    q = _ref_rotate((h @ w[a + "q_proj.weight"].T).view(total, heads, c.head_dim).transpose(0, 1), spec)
    k = _ref_rotate((h @ w[a + "k_proj.weight"].T).view(total, kvh, c.head_dim).transpose(0, 1), spec)
    v = (h @ w[a + "v_proj.weight"].T).view(total, kvh, c.v_head_dim).transpose(0, 1) * c.value_scale
    k, v = k.repeat_interleave(heads // kvh, dim=0), v.repeat_interleave(heads // kvh, dim=0)
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    scores = (q @ k.transpose(1, 2) / math.sqrt(c.head_dim)).masked_fill(~visible, float("-inf"))
    if window:
        sinks = w[a + "sinks"][:, None, None].expand(heads, total, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = (probs @ v).transpose(0, 1).reshape(total, heads * c.v_head_dim)
    return out @ w[a + "o_proj.weight"].T


def _ref_swiglu(w: _Float64View, p: str, h: Tensor) -> Tensor:
    gate, up = h @ w[p + "gate_proj.weight"].T, h @ w[p + "up_proj.weight"].T
    return (gate / (1.0 + torch.exp(-gate)) * up) @ w[p + "down_proj.weight"].T


def _ref_head(c: MiMoV2Config, w: _Float64View, x: Tensor) -> Tensor:
    return (x @ w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"].T).float()


def reference_forward(
    config: MiMoV2Config, hf_weights: dict[str, Tensor], token_ids: list[int]
) -> tuple[Tensor, Tensor]:
    """Dense, unpaged forward over Hugging Face-named weights in float64: (logits [T, V] fp32,
    final-normed hidden states [T, hidden] fp32). Independent of the programs: unfused weights,
    explicit masks and sink columns, complex-number rotary, routing by sorting (moe.reference_moe)."""
    c, w = config, _Float64View(hf_weights)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for i, window in enumerate(c.layer_windows):
        p = f"model.layers.{i}."
        h = _ref_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        x = x + _ref_attention(c, w, p + "self_attn.", h, window)
        h = _ref_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        if c.layer_sparse[i]:
            x = x + moe.reference_moe(moe.MoeBlock(c.router), w, p + "mlp.", h)  # type: ignore[arg-type]  (a dict-like view)
        else:
            x = x + _ref_swiglu(w, p + "mlp.", h)
    x = _ref_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    return _ref_head(c, w, x), x.float()


reference_logits = mtp.logits_of(reference_forward)


def reference_mtp(
    config: MiMoV2Config, hf_weights: dict[str, Tensor], layer: int, next_ids: list[int], hidden: Tensor
) -> tuple[Tensor, Tensor]:
    """One MTP layer over a whole sequence, float64: row t joins next_ids[t] (the token after
    position t) with hidden[t] (the main model's final-normed hidden state at t) and attends over
    rows <= t within the sliding window. Returns (logits [T, V] fp32: the token after next_ids[t],
    MTP hidden states [T, hidden] fp32)."""
    c, w, eps = config, _Float64View(hf_weights), config.rms_norm_eps
    m = f"model.mtp.layers.{layer}."
    embedded = w["model.embed_tokens.weight"][torch.tensor(next_ids)]
    joined = torch.cat(
        [
            _ref_norm(embedded, w[m + "enorm.weight"], eps),
            _ref_norm(hidden.to(torch.float64), w[m + "hnorm.weight"], eps),
        ],
        dim=-1,
    )
    x = joined @ w[m + "eh_proj.weight"].T
    x = x + _ref_attention(c, w, m + "self_attn.", _ref_norm(x, w[m + "input_layernorm.weight"], eps), c.sliding_window)
    x = x + _ref_swiglu(w, m + "mlp.", _ref_norm(x, w[m + "post_attention_layernorm.weight"], eps))
    x = _ref_norm(x, w[m + "final_layernorm.weight"], eps)
    return _ref_head(c, w, x), x.float()


# ----------------------------------------------------------------------- test checkpoints

# ChatML turns, <think> reasoning and MiMo's compact function-tag calls: a small test template
# written for this family (no published MiMo template was found; ignition/models/data/README.md).
TEST_CHAT: str | None = "mimo"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny MiMo-V2-Flash config in the hub's spellings where transformers reads them the same
    (sliding_window_size 7 -> an 8-key window, shorter than a 16-token page): full, sliding,
    sliding, full, sliding layers over 1 / 2 kv heads, 24-wide keys and 16-wide values, partial
    rotary with a theta per type, a dense first (and fourth) layer, sigmoid-routed MoE with 8
    experts top 2 in 2 groups (1 kept) scaled by 2.5, value scale 0.707, one MTP layer."""
    types = [FULL, SLIDING, SLIDING, FULL, SLIDING]
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": len(types),
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 24,
        "v_head_dim": 16,
        "layer_types": types,
        "hybrid_layer_pattern": [int(t == SLIDING) for t in types],
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse"],
        "moe_layer_freq": [0, 1, 1, 0, 1],
        "sliding_window": 7,
        "sliding_window_size": 7,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.334},
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        },
        "attention_value_scale": 0.707,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "attention_bias": False,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def testmodel_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Tensor | None:
    """Sinks spread around zero (some heads lean on theirs, some barely), and selection biases
    small enough that the router's scores still decide, but large enough to change some picks."""
    if name.endswith(("attention_sink_bias", "self_attn.sinks")):
        return torch.randn(shape, generator=generator)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=generator)
    return None


def _attention_shapes(c: MiMoV2Config, sliding: bool) -> dict[str, tuple[int, ...]]:
    h, kvh = c.hidden_size, c.kv_heads(sliding)
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (c.num_heads * c.head_dim, h),
        "self_attn.k_proj.weight": (kvh * c.head_dim, h),
        "self_attn.v_proj.weight": (kvh * c.v_head_dim, h),
        "self_attn.o_proj.weight": (h, c.num_heads * c.v_head_dim),
    }
    if sliding:
        shapes["self_attn.attention_sink_bias"] = (c.num_heads,)
    return shapes


def hf_shapes(c: MiMoV2Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (the hub's layout: per-expert tensors, attention_sink_bias,
    model.mtp.layers.N with pre_mlp_layernorm) and shapes."""
    h, e, f = c.hidden_size, c.router.num_experts, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i, window in enumerate(c.layer_windows):
        layer = _attention_shapes(c, window > 0) | {"post_attention_layernorm.weight": (h,)}
        if c.layer_sparse[i]:
            layer |= {"mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,)}
            layer |= moe.expert_shapes("mlp.", e, h, f)
        else:
            layer |= swiglu_shapes("mlp.", h, c.intermediate_size)
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    for k in range(c.num_mtp_layers):
        layer = (
            _attention_shapes(c, True)
            | swiglu_shapes("mlp.", h, c.intermediate_size)
            | {
                "enorm.weight": (h,),
                "hnorm.weight": (h,),
                "eh_proj.weight": (h, 2 * h),
                "pre_mlp_layernorm.weight": (h,),
                "final_layernorm.weight": (h,),
            }
        )
        shapes |= {f"model.mtp.layers.{k}.{name}": shape for name, shape in layer.items()}
    return shapes


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    mimo_v2_config,
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, init=testmodel_init),
)
