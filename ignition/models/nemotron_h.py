"""The nemotron_h family: NVIDIA's Nemotron-H hybrids (transformers' NemotronHForCausalLM).

What it computes, as transformers 5.24's modeling_nemotron_h does:
- Every layer is `x + mixer(rmsnorm(x))` with one mixer, by `layers_block_type` (or the
  legacy `hybrid_override_pattern`, M / * / - / E):
  * Mamba-2 ("linear_attention", M): in_proj -> (z, xBC, dt); a depthwise causal conv over xBC
    with SiLU (flare::causal_conv1d, the conv window carried in a state slot); x, B, C split
    from it (B and C per group, n_groups groups of heads); the selective scan
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t with
    dt = clamp(softplus(dt + dt_bias), min=time_step_min) and A = -exp(A_log)
    (flare::mamba2_scan, the state [heads, head_dim, ssm_state_size] in a slot); a gated
    RMSNorm rmsnorm_per_group(y * silu(z)) * w over n_groups groups (norm after the gate);
    out_proj.
  * attention ("full_attention", *): GQA without rotary embeddings (no position encoding at
    all), scaled by head_dim ** -0.5, no biases, causal.
  * MLP ("mlp", -): down(relu(up(x))^2), ungated.
  * MoE ("moe", E): a sigmoid router (fp32) with a selection bias (e_score_correction_bias),
    group-limited choice (n_group / topk_group, groups ranked by their top two), top-k weights
    renormalized (+1e-20) and scaled by routed_scaling_factor; ungated relu^2 experts, run
    in a latent space when moe_latent_size is set (fc1_latent_proj before, fc2_latent_proj
    after the routed sum); plus one always-on relu^2 shared expert on the layer input.
- Embeddings unscaled, final norm_f, an untied lm_head (transformers never ties this head).
The time-step clamp is transformers' full-sequence path (`time_step_limit` = (time_step_min,
inf)); its one-token decode path skips it. The op clamps every token the same way, so a
served sequence does not depend on how its prompt was chunked.
Tensors export leaves out: the multi-token-prediction layers (`mtp.*`), as transformers does.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops.mamba  # noqa: F401  (defines flare::mamba2_scan)
import helios.core.ops.recurrent  # noqa: F401  (defines flare::causal_conv1d)
from ignition.models import moe
from ignition.models.common import decode_weight_bytes as dense_decode_weight_bytes
from ignition.models.common import rms_norm
from ignition.models.family import Family, Reference, TinyCheckpoint
from ignition.models.hf_config import Fields, Key
from ignition.models.step import Paged, StatefulStepModule, StepInputs, cached_attention

NAME = "nemotron_h"
HF_ARCHITECTURES = ("NemotronHForCausalLM",)
HF_MODEL_TYPES = ("nemotron_h",)

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_LEGACY = {"mamba": MAMBA, "attention": ATTENTION}  # transformers' remap_legacy_layer_types

_L = "layers.{}."
_MIXER = _L + "mixer."
# Names under the checkpoint's "backbone." (NVIDIA's) or "model." (transformers' own) prefix.
_BODY_MAP = {
    "embeddings.weight": "embed",
    "norm_f.weight": "norm",
    _L + "norm.weight": "layers.{}.norm",
    # Mamba-2
    _MIXER + "in_proj.weight": "layers.{}.in_proj",
    _MIXER + "conv1d.weight": "layers.{}.conv_w",  # [C, 1, K]
    _MIXER + "conv1d.bias": "layers.{}.conv_b",
    _MIXER + "dt_bias": "layers.{}.dt_bias",
    _MIXER + "A_log": "layers.{}.A_log",
    _MIXER + "D": "layers.{}.D",
    _MIXER + "norm.weight": "layers.{}.gated_norm",
    _MIXER + "out_proj.weight": "layers.{}.out_proj",
    # attention
    _MIXER + "q_proj.weight": "layers.{}.wq",
    _MIXER + "k_proj.weight": "layers.{}.wk",
    _MIXER + "v_proj.weight": "layers.{}.wv",
    _MIXER + "o_proj.weight": "layers.{}.wo",
    # MLP
    _MIXER + "up_proj.weight": "layers.{}.w_up",
    _MIXER + "down_proj.weight": "layers.{}.w_down",
    # MoE: per-expert tensors (stacked by STACKED) or transformers' stacks
    _MIXER + "gate.weight": "layers.{}.w_router",
    _MIXER + "gate.e_score_correction_bias": "layers.{}.router_bias",
    _MIXER + "experts.{}.up_proj.weight": "layers.{}.experts.{}.w_up",
    _MIXER + "experts.{}.down_proj.weight": "layers.{}.experts.{}.w_down",
    _MIXER + "experts.up_proj": "layers.{}.w_experts_up",  # [E, F, latent]
    _MIXER + "experts.down_proj": "layers.{}.w_experts_down",  # [E, latent, F]
    _MIXER + "shared_experts.up_proj.weight": "layers.{}.w_shared_up",
    _MIXER + "shared_experts.down_proj.weight": "layers.{}.w_shared_down",
    _MIXER + "fc1_latent_proj.weight": "layers.{}.w_latent_in",
    _MIXER + "fc2_latent_proj.weight": "layers.{}.w_latent_out",
}
WEIGHT_MAP = {
    **{prefix + name: target for prefix in ("backbone.", "model.") for name, target in _BODY_MAP.items()},
    "lm_head.weight": "lm_head",
}

STACKED = {
    "layers.{}.w_experts_up": ("layers.{}.experts.{}.w_up",),
    "layers.{}.w_experts_down": ("layers.{}.experts.{}.w_down",),
}

FUSED = {"layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv")}

RELU2 = moe.ExpertActivation("relu2")
_MTP = re.compile(r"^(?:backbone\.|model\.)?mtp\.")


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # MAMBA, ATTENTION, MLP or MOE per layer
    num_heads: int  # attention layers
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # layer_norm_epsilon: block norms, final norm and the gated norm
    max_position_embeddings: int
    mamba_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int  # B/C groups (and gated-norm groups); mamba_heads % n_groups == 0
    conv_kernel: int
    use_conv_bias: bool
    dt_min: float  # time steps clamped from below (transformers: time_step_min)
    intermediate_size: int  # MLP layers
    moe_intermediate_size: int  # each routed expert
    shared_intermediate_size: int  # the shared expert
    latent_size: int  # moe_latent_size, 0 = experts run at hidden_size
    router: moe.RouterSpec | None  # None without MoE layers
    tie_word_embeddings: bool = False  # never tied (transformers' NemotronH has no tied weights)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)


def _layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """transformers' order: layers_block_type (alias layer_types), else hybrid_override_pattern,
    else its default; legacy names remapped."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is not None:
            unknown = sorted(set(pattern) - set(_PATTERN))
            if unknown:
                raise ValueError(f"hybrid_override_pattern has unknown layer symbols {unknown} (known: M * - E)")
            types = [_PATTERN[ch] for ch in pattern]
        else:
            types = [MAMBA, MOE, ATTENTION, MLP]
    types = [_LEGACY.get(t, t) for t in types]
    unknown = sorted(set(types) - {MAMBA, ATTENTION, MLP, MOE})
    if unknown:
        raise ValueError(
            f"layers_block_type {unknown} are not supported by the {NAME} family "
            f"({MAMBA}, {ATTENTION}, {MLP}, {MOE} are)"
        )
    if MAMBA not in types:
        raise ValueError(f"layers_block_type without a {MAMBA} (Mamba-2) layer is not supported by the {NAME} family")
    return tuple(types)


def _check_supported(hf: dict[str, Any]) -> None:
    def refuse(why: str) -> None:
        raise ValueError(f"{why} is not supported by the {NAME} family")

    if hf.get("quantization_config"):
        refuse("quantization_config (quantized checkpoints)")
    for name in ("use_bias", "mlp_bias", "attention_bias"):
        if hf.get(name):
            refuse(f"{name} = true")
    if hf.get("tie_word_embeddings"):
        refuse("tie_word_embeddings = true (transformers' NemotronH never ties its head; it reads lm_head)")
    if hf.get("sliding_window") is not None:
        refuse(f"sliding_window {hf['sliding_window']} (transformers' NemotronH attention ignores it)")
    if hf.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"mamba_hidden_act {hf['mamba_hidden_act']!r} (the conv activation is SiLU)")
    if hf.get("mlp_hidden_act", "relu2") != "relu2":
        refuse(f"mlp_hidden_act {hf['mlp_hidden_act']!r} (relu2 is)")


# The fields read as they stand in config.json (with transformers' NemotronHConfig defaults); where a
# legacy mamba_* spelling is present too, transformers reads it first.
_FIELDS = Fields(
    NemotronHConfig,
    vocab_size=131072,
    hidden_size=4096,
    head_dim=Key("head_dim", 128, or_default=True),
    rms_norm_eps=Key("layer_norm_epsilon", 1e-5),
    max_position_embeddings=4096,
    mamba_head_dim=64,
    ssm_state_size=128,
    conv_kernel=Key(("mamba_d_conv", "conv_kernel"), 4),
    use_conv_bias=Key(("mamba_conv_bias", "use_conv_bias"), True),
    dt_min=Key(("mamba_dt_min", "time_step_min"), 0.001),
    intermediate_size=21504,
    moe_intermediate_size=7688,
    shared_intermediate_size=Key("moe_shared_expert_intermediate_size", 7688),
    latent_size=Key("moe_latent_size", 0, or_default=True),
)
_N_GROUPS = Key(("mamba_n_groups", "n_groups"), 8)


def config_from_hf(hf: dict[str, Any]) -> NemotronHConfig:
    """Read a Hugging Face config.json dict (transformers' defaults for absent fields);
    unsupported variants raise ValueError naming the field."""
    _check_supported(hf)
    types = _layer_types(hf)
    heads = int(hf.get("num_attention_heads", 32))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
    mamba_heads, groups = int(hf.get("mamba_num_heads", 128)), int(_N_GROUPS.value(hf))
    if groups < 1 or mamba_heads % groups:
        raise ValueError(f"n_groups {groups} must divide mamba_num_heads {mamba_heads}")
    router = None
    if MOE in types:
        router = moe.RouterSpec(
            num_experts=int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 8),
            top_k=int(hf.get("num_experts_per_tok", 2)),
            scoring="sigmoid",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            n_group=int(hf.get("n_group", 1)),
            topk_group=int(hf.get("topk_group", 1)),
            has_correction_bias=True,
            norm_eps=1e-20,
        )
        if router.n_group == 1 and router.num_experts < 2:
            raise ValueError("n_routed_experts must be at least 2 (transformers ranks the expert group by its top two)")
    return NemotronHConfig(
        **_FIELDS.read(hf),
        num_layers=len(types),
        layer_types=types,
        num_heads=heads,
        num_kv_heads=kv_heads,
        mamba_heads=mamba_heads,
        n_groups=groups,
        router=router,
    )


def ignored_tensor(config: NemotronHConfig, name: str) -> bool:
    """The multi-token-prediction layers (`mtp.*`), which transformers does not load either."""
    return _MTP.match(name) is not None


def kv_shape(config: NemotronHConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim): pages for every layer; only attention layers use theirs."""
    return config.num_layers, config.num_kv_heads, config.head_dim


def state_caches(config: NemotronHConfig) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...], str], ...]:
    """Each Mamba layer's conv window (last K - 1 xBC inputs) and SSM state, fp32."""
    layers = config.mamba_layers
    return (
        ("conv", layers, (config.conv_dim, config.conv_kernel - 1), "float32"),
        ("ssm", layers, (config.mamba_heads, config.mamba_head_dim, config.ssm_state_size), "float32"),
    )


def decode_weight_bytes(config: NemotronHConfig, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: everything but the embedding table, and of each expert
    stack only the top-k experts the token is routed to."""
    total = dense_decode_weight_bytes(config, weights)
    if config.router is not None:
        for name, t in weights.items():
            if name.endswith((".w_experts_up", ".w_experts_down")):
                total -= t.numel() * t.element_size() * (t.shape[0] - config.router.top_k) // t.shape[0]
    return total


# ---------------------------------------------------------------------------- step program


def gated_norm(y: Tensor, z: Tensor, weight: Tensor, groups: int, eps: float) -> Tensor:
    """transformers' NemotronHRMSNormGated: RMS-normalize y * silu(z) per group, then scale; fp32."""
    g = (y * F.silu(z)).view(y.shape[0], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * g.view(y.shape)


def relu2_mlp(h: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """down(relu(up(h))^2): h [T, H] in the core dtype -> [T, H] fp32."""
    return F.linear(torch.relu(F.linear(h, w_up).float()).square().to(h.dtype), w_down).float()


class StepProgram(StatefulStepModule):
    """The step over kv_cache = [k0, v0, ..., k_{L-1}, v_{L-1}, conv_m0, conv_m1, ..., ssm_m0, ssm_m1, ...]."""

    def mamba(
        self,
        weights: dict[str, Tensor],
        i: int,
        h: Tensor,
        conv_state: Tensor,
        ssm_state: Tensor,
        recurrent: tuple[Tensor, ...],
    ) -> Tensor:
        """h [T, hidden] in the core dtype -> the Mamba-2 mixer's output [T, hidden] fp32."""
        c, p = self.config, f"layers.{i}."
        state_slots, query_start_loc, positions = recurrent
        total, groups, n = h.shape[0], c.n_groups, c.ssm_state_size
        proj = F.linear(h, weights[p + "in_proj"]).float()
        z, xbc, dt = proj.split([c.mamba_inner, c.conv_dim, c.mamba_heads], dim=-1)
        conv_w = weights[p + "conv_w"].reshape(c.conv_dim, c.conv_kernel)
        conv_b = weights[p + "conv_b"] if c.use_conv_bias else torch.zeros(c.conv_dim, dtype=conv_w.dtype)
        xbc = torch.ops.flare.causal_conv1d(
            xbc, conv_w, conv_b, conv_state, state_slots, query_start_loc, positions, True
        )
        x, b, cc = xbc.float().split([c.mamba_inner, groups * n, groups * n], dim=-1)
        a = -torch.exp(weights[p + "A_log"].float())
        y = torch.ops.flare.mamba2_scan(
            x.reshape(total, c.mamba_heads, c.mamba_head_dim),
            dt,
            a,
            b.reshape(total, groups, n),
            cc.reshape(total, groups, n),
            weights[p + "D"],
            weights[p + "dt_bias"],
            ssm_state,
            state_slots,
            query_start_loc,
            positions,
            c.dt_min,
            0.0,
        )
        y = gated_norm(y.reshape(total, c.mamba_inner), z, weights[p + "gated_norm"], groups, c.rms_norm_eps)
        return F.linear(y.to(h.dtype), weights[p + "out_proj"]).float()

    def attention(self, weights: dict[str, Tensor], i: int, h: Tensor, kv_cache: list[Tensor], paged: Paged) -> Tensor:
        """h [T, hidden] -> causal GQA without position encoding [T, hidden] fp32."""
        c, p = self.config, f"layers.{i}."
        q_dim = c.num_heads * c.head_dim
        q, k, v = F.linear(h, weights[p + "wqkv"]).float().split([q_dim, c.kv_dim, c.kv_dim], dim=-1)
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = q.reshape(-1, heads, d), k.reshape(-1, kv_heads, d), v.reshape(-1, kv_heads, d)
        attn = cached_attention(q, k, v, kv_cache[2 * i], kv_cache[2 * i + 1], paged, 1.0 / math.sqrt(d))
        return F.linear(attn.reshape(-1, q_dim).to(h.dtype), weights[p + "wo"]).float()

    def moe(self, weights: dict[str, Tensor], i: int, h: Tensor) -> Tensor:
        """Sigmoid-routed relu^2 experts (in the latent space when there is one) plus the shared expert."""
        c, p = self.config, f"layers.{i}."
        assert c.router is not None
        logits = F.linear(h.float(), weights[p + "w_router"].float())
        top, ids = moe.route(c.router, logits, weights[p + "router_bias"])
        x = F.linear(h, weights[p + "w_latent_in"]) if c.latent_size else h
        routed = moe.routed_mlp(x, top, ids, weights[p + "w_experts_up"], weights[p + "w_experts_down"], RELU2)
        if c.latent_size:
            routed = F.linear(routed.to(h.dtype), weights[p + "w_latent_out"]).float()
        return routed + moe.shared_mlp(h, weights[p + "w_shared_up"], weights[p + "w_shared_down"], RELU2)

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        c = self.config
        # Weights and matmul inputs in the core's dtype; residual stream, norms, router, conv
        # and scan in fp32.
        wdt = weights["embed"].dtype
        x = F.embedding(s.token_ids, weights["embed"]).float()
        paged, recurrent = s.paged, s.recurrent
        state_base, num_mamba = 2 * c.num_layers, len(c.mamba_layers)
        for i, kind in enumerate(c.layer_types):
            h = rms_norm(x, weights[f"layers.{i}.norm"], c.rms_norm_eps).to(wdt)
            if kind == MAMBA:
                j = c.mamba_layers.index(i)
                conv, ssm = kv_cache[state_base + j], kv_cache[state_base + num_mamba + j]
                x = x + self.mamba(weights, i, h, conv, ssm, recurrent)
            elif kind == ATTENTION:
                x = x + self.attention(weights, i, h, kv_cache, paged)
            elif kind == MLP:
                x = x + relu2_mlp(h, weights[f"layers.{i}.w_up"], weights[f"layers.{i}.w_down"])
            else:
                x = x + self.moe(weights, i, h)
        x = rms_norm(x, weights["norm"], c.rms_norm_eps).to(wdt)
        return self.outputs(x, weights, s)


# ---------------------------------------------------------------------- plain reference


def _canonical(name: str) -> str:
    return name.removeprefix("backbone.").removeprefix("model.")


def reference_logits(config: NemotronHConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """Dense, unpaged forward over checkpoint-named weights (either layout) in float64: logits [T, V] fp32.

    Independent of the program: the scan as a per-token recurrence, the conv as an explicit
    sum over its taps, the attention matrix explicit, routing by sorting and a loop over experts.
    """
    c = config
    f64 = torch.float64
    w = {_canonical(k): v for k, v in hf_weights.items() if not ignored_tensor(c, k)}
    W = lambda name: w[name].to(f64)  # noqa: E731
    T = len(token_ids)
    x = W("embeddings.weight")[torch.tensor(token_ids)]

    def norm(t: Tensor, weight: Tensor) -> Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weight

    def relu2(t: Tensor) -> Tensor:
        return t.clamp(min=0) ** 2

    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}.mixer."
        h = norm(x, W(f"layers.{i}.norm.weight"))
        if kind == MAMBA:
            x = x + _reference_mamba(c, W, p, h)
        elif kind == ATTENTION:
            q = (h @ W(p + "q_proj.weight").T).view(T, c.num_heads, c.head_dim).transpose(0, 1)
            k = (h @ W(p + "k_proj.weight").T).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = (h @ W(p + "v_proj.weight").T).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
            group = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(c.head_dim)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            x = x + (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1) @ W(p + "o_proj.weight").T
        elif kind == MLP:
            x = x + relu2(h @ W(p + "up_proj.weight").T) @ W(p + "down_proj.weight").T
        else:
            x = (
                x
                + _reference_moe(c, W, set(w), p, h)
                + relu2(h @ W(p + "shared_experts.up_proj.weight").T) @ W(p + "shared_experts.down_proj.weight").T
            )
    x = norm(x, W("norm_f.weight"))
    return (x @ W("lm_head.weight").T).float()


def _reference_mamba(c: NemotronHConfig, W, p: str, h: Tensor) -> Tensor:
    """One Mamba-2 mixer over a whole sequence from zero state, h [T, hidden] float64."""
    T, inner, groups, n, heads = h.shape[0], c.mamba_inner, c.n_groups, c.ssm_state_size, c.mamba_heads
    proj = h @ W(p + "in_proj.weight").T
    z, xbc, dt = proj[:, :inner], proj[:, inner : inner + c.conv_dim], proj[:, inner + c.conv_dim :]
    taps = W(p + "conv1d.weight")[:, 0, :]  # [C, K]: tap K-1 multiplies the current input
    conv = W(p + "conv1d.bias").expand(T, -1).clone() if c.use_conv_bias else torch.zeros(T, c.conv_dim, dtype=h.dtype)
    for k in range(c.conv_kernel):
        shift = c.conv_kernel - 1 - k  # tap k reads the input `shift` tokens back
        conv[shift:] += xbc[: T - shift] * taps[:, k]
    xbc = conv * torch.sigmoid(conv)
    xs = xbc[:, :inner].view(T, heads, c.mamba_head_dim)
    bs = xbc[:, inner : inner + groups * n].view(T, groups, n).repeat_interleave(heads // groups, dim=1)
    cs = xbc[:, inner + groups * n :].view(T, groups, n).repeat_interleave(heads // groups, dim=1)
    steps = torch.log1p(torch.exp(dt + W(p + "dt_bias"))).clamp(min=c.dt_min)  # [T, H]
    a = -torch.exp(W(p + "A_log"))
    d = W(p + "D")
    state = torch.zeros(heads, c.mamba_head_dim, n, dtype=h.dtype)
    ys = []
    for t in range(T):
        inflow = steps[t][:, None, None] * xs[t][:, :, None] * bs[t][:, None, :]  # [H, P, N]
        state = state * torch.exp(steps[t] * a)[:, None, None] + inflow
        ys.append((state * cs[t][:, None, :]).sum(-1) + d[:, None] * xs[t])
    y = torch.stack(ys).reshape(T, inner) * (z * torch.sigmoid(z))
    g = y.view(T, groups, -1)
    y = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).reshape(T, inner) * W(p + "norm.weight")
    return y @ W(p + "out_proj.weight").T


def _reference_moe(c: NemotronHConfig, W, names: set[str], p: str, h: Tensor) -> Tensor:
    """The routed experts of one MoE layer (either expert layout), h [T, hidden] float64."""
    r = c.router
    assert r is not None
    scores = 1.0 / (1.0 + torch.exp(-(h @ W(p + "gate.weight").T)))  # [T, E]
    choice = scores + W(p + "gate.e_score_correction_bias")
    if r.n_group > 1:
        per = r.num_experts // r.n_group
        strength = choice.view(-1, r.n_group, per).sort(-1, descending=True).values[..., :2].sum(-1)
        kept = strength.argsort(-1, descending=True)[:, : r.topk_group]
        allowed = torch.zeros_like(strength, dtype=torch.bool).scatter(1, kept, True).repeat_interleave(per, dim=1)
        choice = choice.masked_fill(~allowed, float("-inf"))
    ids = choice.argsort(-1, descending=True)[:, : r.top_k]
    top = scores.gather(1, ids)
    if r.norm_topk_prob:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * r.routed_scaling_factor
    x = h @ W(p + "fc1_latent_proj.weight").T if c.latent_size else h
    stacked = p + "experts.up_proj" in names
    out = torch.zeros_like(x)
    for e in range(r.num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            up = W(p + "experts.up_proj")[e] if stacked else W(f"{p}experts.{e}.up_proj.weight")
            down = W(p + "experts.down_proj")[e] if stacked else W(f"{p}experts.{e}.down_proj.weight")
            out.index_add_(0, rows, (x[rows] @ up.T).clamp(min=0) ** 2 @ down.T * top[rows, slots, None])
    return out @ W(p + "fc2_latent_proj.weight").T if c.latent_size else out


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Nemotron 3 Nano's tokens and published template (testmodel.CHATS "nemotron").
TEST_CHAT: str | None = "nemotron"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Nemotron-H config in NVIDIA's spellings (hybrid_override_pattern, mamba_* names):
    Mamba, MoE, attention, Mamba, MLP layers; 8 Mamba heads of 8 channels in 2 groups with a
    16-wide state; MoE of 8 relu^2 experts in 2 groups (one kept, top 2, selection bias,
    scaling 2.5) in a 32-wide latent space plus a shared expert; one MTP layer (left out)."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "hybrid_override_pattern": "ME*M-",
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "mamba_n_groups": 2,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 8,  # transformers' chunked scan then runs several chunks per prompt
        "mamba_hidden_act": "silu",
        "mamba_dt_min": 0.001,
        "mamba_dt_max": 0.1,
        "use_conv_bias": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "moe_latent_size": 32,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*E",
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def hf_shapes(c: NemotronHConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (NVIDIA's layout: backbone., per-expert tensors) and shapes, plus
    a few MTP-layer tensors as the published checkpoints carry them."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (c.vocab_size, h)}
    for i, kind in enumerate(c.layer_types):
        m = f"backbone.layers.{i}.mixer."
        shapes[f"backbone.layers.{i}.norm.weight"] = (h,)
        if kind == MAMBA:
            heads, inner = c.mamba_heads, c.mamba_inner
            shapes |= {
                m + "dt_bias": (heads,),
                m + "A_log": (heads,),
                m + "D": (heads,),
                m + "conv1d.weight": (c.conv_dim, 1, c.conv_kernel),
                m + "in_proj.weight": (inner + c.conv_dim + heads, h),
                m + "norm.weight": (inner,),
                m + "out_proj.weight": (h, inner),
            }
            if c.use_conv_bias:
                shapes[m + "conv1d.bias"] = (c.conv_dim,)
        elif kind == ATTENTION:
            q = c.num_heads * c.head_dim
            shapes |= {
                m + "q_proj.weight": (q, h),
                m + "k_proj.weight": (c.kv_dim, h),
                m + "v_proj.weight": (c.kv_dim, h),
                m + "o_proj.weight": (h, q),
            }
        elif kind == MLP:
            shapes |= {m + "up_proj.weight": (c.intermediate_size, h), m + "down_proj.weight": (h, c.intermediate_size)}
        else:
            assert c.router is not None
            e, f, s, lat = c.router.num_experts, c.moe_intermediate_size, c.shared_intermediate_size, c.latent_size or h
            shapes |= {m + "gate.weight": (e, h), m + "gate.e_score_correction_bias": (e,)}
            for j in range(e):
                shapes |= {f"{m}experts.{j}.up_proj.weight": (f, lat), f"{m}experts.{j}.down_proj.weight": (lat, f)}
            shapes |= {m + "shared_experts.up_proj.weight": (s, h), m + "shared_experts.down_proj.weight": (h, s)}
            if c.latent_size:
                shapes |= {m + "fc1_latent_proj.weight": (lat, h), m + "fc2_latent_proj.weight": (h, lat)}
    shapes |= {
        "backbone.norm_f.weight": (h,),
        "lm_head.weight": (c.vocab_size, h),
        "mtp.layers.0.norm.weight": (h,),
        "mtp.layers.0.mixer.q_proj.weight": (c.num_heads * c.head_dim, h),
    }
    return shapes


def testmodel_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Tensor | None:
    """Mamba parameters as trained layers have them: A_log = log(A) for A in [1, 8], time steps
    softplus(dt_bias) in [0.02, 0.2], small conv taps and biases; small selection biases."""
    if name.endswith("mixer.A_log"):
        return torch.log(1.0 + 7.0 * torch.rand(shape, generator=generator))
    if name.endswith("mixer.dt_bias"):
        dt = torch.exp(math.log(0.02) + torch.rand(shape, generator=generator) * math.log(10.0))
        return dt + torch.log(-torch.expm1(-dt))  # softplus^-1, as transformers initializes it
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    if name.endswith(("conv1d.bias", "e_score_correction_bias")):
        return 0.1 * torch.randn(shape, generator=generator)
    return None


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, init=testmodel_init),
)
