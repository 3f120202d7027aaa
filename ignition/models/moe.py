"""Mixture-of-experts pieces shared by every MoE family (Qwen3-MoE, DeepSeek V3/V4, Kimi,
GLM-5, MiniMax, Step, Muse Spark).

The step program routes each token (`route`: scores -> optional group limit -> top-k ->
weights) and runs only the chosen experts through `flare::routed_experts` over the
layer's stacked expert weights. `reference_moe` is an independent plain-torch forward of
the same layer over Hugging Face-named weights for the export self-check, and
`stack_experts` is export's hook that turns per-expert checkpoint tensors into stacks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.moe import ACTIVATIONS, expert_forward  # importing it also defines flare::routed_experts
from ignition.errors import SourceError
from ignition.models.common import decode_weight_bytes as dense_decode_weight_bytes
from ignition.models.common import swiglu_shapes

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a layer's router turns logits [T, E] into top-k (weights, expert ids)."""

    num_experts: int
    top_k: int  # experts per token, 1 <= top_k <= num_experts
    scoring: str  # one of SCORINGS: softmax over experts (Qwen), sigmoid (DeepSeek-V3), sqrt(softplus) (V4)
    norm_topk_prob: bool  # divide the chosen weights by their sum (+ norm_eps)
    routed_scaling_factor: float = 1.0  # multiplies the final weights
    n_group: int = 1  # expert groups for group-limited routing (DeepSeek-V3); 1 = no groups
    topk_group: int = 1  # groups kept per token; only with n_group > 1
    has_correction_bias: bool = False  # a per-expert bias added to the scores for selection only
    norm_eps: float = 0.0  # added to the renormalization sum (DeepSeek-V3/GLM 1e-20, Muse Spark 1e-15)
    logit_scale: float = 1.0  # multiplies the logits before scoring (Muse Spark's output_multiplier)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} is not supported (supported: {', '.join(SCORINGS)})")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide num_experts {self.num_experts}")
        if self.n_group > 1 and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be between 1 and n_group {self.n_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(
                "group-limited routing needs at least two experts per group (groups score by their top two)"
            )
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group {self.topk_group} groups hold fewer than top_k {self.top_k} experts")


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """The gated activation of a family's experts (helios.core.ops_moe.ACTIVATIONS)."""

    name: str = "silu"
    limit: float = 0.0  # clamp bound of gate and up; 0 = no clamp
    alpha: float = 1.0  # only for clamped_glu: g * sigmoid(alpha * g)

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.limit < 0:
            raise ValueError(f"the activation limit must be >= 0 (0 = none), got {self.limit}")


SWIGLU = ExpertActivation()


@dataclass(frozen=True, slots=True)
class MoeBlock:
    """A MoE layer as the program (sparse_moe) and the reference (reference_moe) both run it, so a family
    states it once: the routing, the routed experts' activation, and whether a shared expert joins
    (with `shared_activation`, else the routed one)."""

    router: RouterSpec
    activation: ExpertActivation = SWIGLU
    shared: bool = False
    shared_activation: ExpertActivation | None = None

    @property
    def shared_act(self) -> ExpertActivation:
        return self.shared_activation or self.activation


# ---------------------------------------------------------------------------- step program


def scores(spec: RouterSpec, router_logits: Tensor) -> Tensor:
    """The unbiased per-expert scores [T, E] fp32 the routing weights are taken from."""
    logits = router_logits.float() * spec.logit_scale if spec.logit_scale != 1.0 else router_logits.float()
    if spec.scoring == "softmax":
        return logits.softmax(dim=-1)
    if spec.scoring == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def weights_at(spec: RouterSpec, probs: Tensor, ids: Tensor) -> Tensor:
    """Routing weights [T, K] fp32 of the experts `ids` [T, K] given the unbiased scores `probs` [T, E].

    Public for routers that choose experts some other way (DeepSeek-V4's hash layers pick
    ids from the token id and still weight them by the learned scores).
    """
    weights = probs.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.norm_eps)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights


def route(spec: RouterSpec, router_logits: Tensor, correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (weights [T, K] fp32, expert ids [T, K] int64); traceable.

    Selection ranks `scores + correction_bias` (when the spec has one) within the groups a
    token keeps (each group ranked by the sum of its two best biased scores); the weights
    are the unbiased scores at the chosen ids, renormalized and scaled as the spec says.
    """
    if spec.has_correction_bias != (correction_bias is not None):
        raise ValueError(f"the router spec {'needs' if spec.has_correction_bias else 'takes no'} correction bias")
    probs = scores(spec, router_logits)
    choice = probs + correction_bias.float() if correction_bias is not None else probs
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        per_group = spec.num_experts // spec.n_group
        grouped = choice.view(-1, spec.n_group, per_group)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(spec.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(-1, spec.num_experts)
    ids = choice.topk(spec.top_k, dim=-1).indices
    return weights_at(spec, probs, ids), ids


def routed_mlp(
    h: Tensor,
    weights: Tensor,
    ids: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: ExpertActivation = SWIGLU,
    post_norm_scale: Tensor | None = None,
    post_norm_eps: float = 1e-6,
) -> Tensor:
    """The routed experts of h [T, H] -> [T, H] fp32 (only each token's chosen experts run).

    w_gate_up [E, 2F, H] (gate rows first), w_down [E, H, F]; weights/ids from `route`.
    post_norm_scale [H]: Muse Spark's per-expert output norm (pass 1 + its weight).
    """
    return torch.ops.flare.routed_experts(
        h,
        weights,
        ids,
        w_gate_up,
        w_down,
        activation.name,
        activation.limit,
        activation.alpha,
        post_norm_scale,
        post_norm_eps,
    )


def shared_mlp(h: Tensor, w_gate_up: Tensor, w_down: Tensor, activation: ExpertActivation = SWIGLU) -> Tensor:
    """An always-on shared expert: h [T, H], fused w_gate_up [2S, H], w_down [H, S] -> [T, H] fp32."""
    return expert_forward(h, w_gate_up, w_down, activation.name, activation.limit, activation.alpha)


def local_experts(top: Tensor, ids: Tensor, start: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """An expert-parallel rank's share of the routing (ignition.parallel): the choices of its experts
    start .. start + count - 1 as local ids with their weights; every other choice weighs 0 (on local
    expert 0), so the rank's output is its experts' part of the routed sum."""
    local = ids - start
    mine = (local >= 0) & (local < count)
    return torch.where(mine, top, torch.zeros_like(top)), local.clamp(0, count - 1)


def sparse_moe(block: MoeBlock, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
    """One MoE layer over the standard internal names (expert_weight_map, STACKED_EXPERTS,
    shared_expert_weight_map + SHARED_EXPERT_FUSED): h [T, H] in the core dtype -> routed (+ shared) output [T, H] fp32.

    The router runs in fp32 whatever the core dtype: a bf16 router flips near-tied expert
    choices, the largest error a 16-bit MoE core can make against its reference.
    """
    p, spec = f"layers.{layer}.", block.router
    logits = F.linear(h.float(), weights[p + "w_router"].float())
    bias = weights[p + "router_bias"] if spec.has_correction_bias else None
    top, ids = route(spec, logits, bias)
    if "expert_start" in weights:  # an expert-parallel rank: its experts only, the ranks' sums added by the caller
        top, ids = local_experts(top, ids, weights["expert_start"], weights[p + "w_experts_gate_up"].shape[0])
    out = routed_mlp(h, top, ids, weights[p + "w_experts_gate_up"], weights[p + "w_experts_down"], block.activation)
    if block.shared:
        out = out + shared_mlp(h, weights[p + "w_shared_gate_up"], weights[p + "w_shared_down"], block.shared_act)
    return out


# ---------------------------------------------------------------------- weight naming

# Internal stacks built from per-expert tensors (second `{}` = expert), see `stack_experts`.
STACKED_EXPERTS = {
    "layers.{}.w_experts_gate_up": ("layers.{}.experts.{}.w_gate", "layers.{}.experts.{}.w_up"),
    "layers.{}.w_experts_down": ("layers.{}.experts.{}.w_down",),
}

# The fused shared expert (a family adds it to FUSED).
SHARED_EXPERT_FUSED = {"layers.{}.w_shared_gate_up": ("layers.{}.shared.w_gate", "layers.{}.shared.w_up")}


def expert_weight_map(
    mlp: str = "model.layers.{}.mlp.",
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    router: str = "gate",
) -> dict[str, str]:
    """Hugging Face -> internal names of a MoE block under `mlp`, in both checkpoint layouts:
    per-expert tensors (`experts.{E}.gate_proj.weight`, stacked later by STACKED_EXPERTS) and
    transformers 5's stacked ones (`stacked_expert_weight_map`)."""
    return {
        **stacked_expert_weight_map(mlp, router),
        f"{mlp}experts.{{}}.{gate}.weight": "layers.{}.experts.{}.w_gate",
        f"{mlp}experts.{{}}.{up}.weight": "layers.{}.experts.{}.w_up",
        f"{mlp}experts.{{}}.{down}.weight": "layers.{}.experts.{}.w_down",
    }


def stacked_expert_weight_map(mlp: str = "model.layers.{}.mlp.", router: str = "gate") -> dict[str, str]:
    """Hugging Face -> internal names of a MoE block under `mlp` in transformers 5's stacked layout only:
    the router and its correction bias, `experts.gate_up_proj` [E, 2F, H] and `experts.down_proj` [E, H, F]."""
    return {
        f"{mlp}{router}.weight": "layers.{}.w_router",
        f"{mlp}{router}.e_score_correction_bias": "layers.{}.router_bias",
        f"{mlp}experts.gate_up_proj": "layers.{}.w_experts_gate_up",
        f"{mlp}experts.down_proj": "layers.{}.w_experts_down",
    }


def shared_expert_weight_map(mlp: str = "model.layers.{}.mlp.", name: str = "shared_experts") -> dict[str, str]:
    """Hugging Face -> internal names of a DeepSeek-style shared expert (fused by SHARED_EXPERT_FUSED)."""
    return {
        f"{mlp}{name}.gate_proj.weight": "layers.{}.shared.w_gate",
        f"{mlp}{name}.up_proj.weight": "layers.{}.shared.w_up",
        f"{mlp}{name}.down_proj.weight": "layers.{}.w_shared_down",
    }


def expert_shapes(prefix: str, num_experts: int, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    """Test-checkpoint shapes of per-expert SwiGLU tensors under `prefix` (e.g. "mlp."), expert by expert."""
    return {
        name: shape
        for e in range(num_experts)
        for name, shape in swiglu_shapes(f"{prefix}experts.{e}.", hidden, width).items()
    }


def _part_pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def stack_experts(stacked: Mapping[str, tuple[str, ...]], named: dict[str, Tensor], reference: str) -> None:
    """Export's stacking step, in place: for each target, per layer, the parts become one
    [E, rows, cols] tensor: per-expert parts (pattern with a second `{}`) are stacked over
    experts 0..E-1, already-stacked parts (one `{}`, [E, r, c]) taken as they are, and the
    parts concatenated along their rows (dim 1), like FUSED does for 2-D tensors.

    Layers where no part exists are left alone (dense layers, or a checkpoint that already
    stores the target); a layer holding some parts but not all is an error.
    """
    for target, parts in stacked.items():
        patterns = [_part_pattern(p) for p in parts]
        found: dict[int, dict[int, dict[int, str]]] = {}  # layer -> part -> expert (-1: stacked) -> name
        for name in named:
            for index, pattern in enumerate(patterns):
                match = pattern.match(name)
                if match:
                    numbers = [int(g) for g in match.groups()]
                    expert = numbers[1] if len(numbers) > 1 else -1
                    found.setdefault(numbers[0], {}).setdefault(index, {})[expert] = name
                    break
        for layer, by_part in sorted(found.items()):
            out = target.format(layer)
            if out in named:
                raise SourceError(f"{reference}: layer {layer} stores its experts both stacked and per expert")
            missing = [parts[i] for i in range(len(parts)) if i not in by_part]
            if missing:
                raise SourceError(f"{reference}: layer {layer} lacks expert tensors {missing}")
            blocks = [_stack_part(by_part[i], named, reference, layer) for i in range(len(parts))]
            if len({b.shape[0] for b in blocks}) != 1:
                raise SourceError(f"{reference}: layer {layer}'s expert tensors disagree on the number of experts")
            named[out] = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]


def _stack_part(experts: dict[int, str], named: dict[str, Tensor], reference: str, layer: int) -> Tensor:
    if -1 in experts:
        return named.pop(experts[-1])
    if sorted(experts) != list(range(len(experts))):
        gaps = sorted(set(range(max(experts) + 1)) - set(experts))
        raise SourceError(f"{reference}: layer {layer} lacks experts {gaps[:8]}")
    return torch.stack([named.pop(experts[e]) for e in range(len(experts))])


def decode_weight_bytes(config: Any, weights: dict[str, Tensor], top_k: int) -> int:
    """Weights one decode token reads: like common.decode_weight_bytes, but of each expert
    stack only the top_k experts the token is routed to."""
    total = dense_decode_weight_bytes(config, weights)
    for name, t in weights.items():
        if name.endswith((".w_experts_gate_up", ".w_experts_down")):
            total -= t.numel() * t.element_size() * (t.shape[0] - top_k) // t.shape[0]
    return total


# ---------------------------------------------------------------------- plain reference


def _reference_scores(spec: RouterSpec, logits: Tensor) -> Tensor:
    logits = logits * spec.logit_scale
    if spec.scoring == "softmax":
        e = (logits - logits.max(-1, keepdim=True).values).exp()
        return e / e.sum(-1, keepdim=True)
    if spec.scoring == "sigmoid":
        return 1.0 / (1.0 + (-logits).exp())
    return torch.log1p(logits.exp()).sqrt()


def _reference_choice(spec: RouterSpec, choice: Tensor) -> Tensor:
    """Expert ids [T, K] by sorting (not topk), within each token's best groups."""
    total = choice.shape[0]
    if spec.n_group > 1:
        per_group = spec.num_experts // spec.n_group
        strength = choice.view(total, spec.n_group, per_group).sort(-1, descending=True).values[..., :2].sum(-1)
        best = strength.argsort(-1, descending=True)[:, : spec.topk_group]
        allowed = torch.zeros(total, spec.n_group, dtype=torch.bool)
        allowed[torch.arange(total)[:, None], best] = True
        choice = torch.where(allowed.repeat_interleave(per_group, dim=1), choice, torch.tensor(float("-inf")))
    return choice.argsort(-1, descending=True)[:, : spec.top_k]


def _reference_act(gate: Tensor, up: Tensor, act: ExpertActivation) -> Tensor:
    if act.limit > 0:
        up = up.clamp(-act.limit, act.limit)
        if act.name != "silu_clamp_after":
            gate = gate.clamp(max=act.limit)
    if act.name == "clamped_glu":
        return gate / (1.0 + (-act.alpha * gate).exp()) * (up + 1.0)
    silu = gate / (1.0 + (-gate).exp())
    if act.name == "silu_clamp_after" and act.limit > 0:
        silu = silu.clamp(max=act.limit)
    return silu * up


def _reference_expert(
    w: dict[str, Tensor], experts: str, e: int, names: tuple[str, str, str], x: Tensor, act: ExpertActivation
) -> Tensor:
    if experts + "gate_up_proj" in w:  # transformers 5's stacked layout
        gate, up = (x @ w[experts + "gate_up_proj"][e].T).chunk(2, dim=-1)
        down = w[experts + "down_proj"][e]
    else:
        gate, up = (x @ w[f"{experts}{e}.{n}.weight"].T for n in names[:2])
        down = w[f"{experts}{e}.{names[2]}.weight"]
    return _reference_act(gate, up, act) @ down.T


def reference_moe(
    block: MoeBlock,
    w: dict[str, Tensor],
    prefix: str,
    h: Tensor,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    router: str = "gate",
    ids: Tensor | None = None,
) -> Tensor:
    """A MoE block under `prefix` (e.g. "model.layers.3.mlp.") over fp32 Hugging Face-named
    weights, h [T, H] -> [T, H]; independent of the program path (sorting instead of topk,
    one loop over experts with only their chosen tokens, per-expert or stacked weights).

    `ids` [T, K] fixes the choice (hash routing); the block's shared expert is `shared_experts.*`.
    """
    spec = block.router
    logits = h @ w[f"{prefix}{router}.weight"].T
    probs = _reference_scores(spec, logits)
    if ids is None:
        bias = w[f"{prefix}{router}.e_score_correction_bias"] if spec.has_correction_bias else 0.0
        ids = _reference_choice(spec, probs + bias)
    top = torch.stack([probs[t, ids[t]] for t in range(h.shape[0])]) if h.shape[0] else probs.new_zeros(0, spec.top_k)
    if spec.norm_topk_prob:
        top = top / (top.sum(-1, keepdim=True) + spec.norm_eps)
    top = top * spec.routed_scaling_factor
    out = torch.zeros_like(h)
    for e in range(spec.num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y = _reference_expert(w, prefix + "experts.", e, names, h[rows], block.activation)
            out.index_add_(0, rows, y * top[rows, slots, None])
    if block.shared:
        s = prefix + "shared_experts."
        gate, up = h @ w[s + "gate_proj.weight"].T, h @ w[s + "up_proj.weight"].T
        out = out + _reference_act(gate, up, block.shared_act) @ w[s + "down_proj.weight"].T
    return out
