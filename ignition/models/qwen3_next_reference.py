"""The qwen3_next family's plain-torch reference forward, for the export self-check.

Independent of the step program on purpose: float64, unfused Hugging Face-named weights (Qwen3-Next's
grouped projections are re-ordered as weight rows, not as activations), explicit attention
matrices, the conv as an explicit sum over its taps, the delta rule token by token, and
moe.reference_moe's own routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import moe, mtp
from ignition.models.qwen3_next_config import FULL, Qwen3NextConfig, canonical_name, ignored_tensor

F64 = torch.float64


def _flat_projections(c: Qwen3NextConfig, w: dict[str, Tensor], p: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W_qkv [conv_dim, H], W_z, W_b, W_a) of a DeltaNet layer in Qwen3.5's flat row order."""
    if not c.grouped_projections:
        return tuple(w[p + f"linear_attn.in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a"))  # type: ignore[return-value]
    kh, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    group = c.linear_num_value_heads // kh
    qkvz = w[p + "linear_attn.in_proj_qkvz.weight"]
    rows = qkvz.shape[0] // kh
    blocks = [qkvz[g * rows : (g + 1) * rows] for g in range(kh)]  # one block of rows per key head
    bounds = [0, dk, 2 * dk, 2 * dk + group * dv, rows]
    part = lambda n: torch.cat([blk[bounds[n] : bounds[n + 1]] for blk in blocks])  # noqa: E731
    ba = w[p + "linear_attn.in_proj_ba.weight"]
    b = torch.cat([ba[g * 2 * group : g * 2 * group + group] for g in range(kh)])
    a = torch.cat([ba[g * 2 * group + group : (g + 1) * 2 * group] for g in range(kh)])
    return torch.cat([part(0), part(1), part(2)]), part(3), b, a


def _delta_net(c: Qwen3NextConfig, w: dict[str, Tensor], p: str, h: Tensor) -> Tensor:
    total = h.shape[0]
    kh, vh, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    w_qkv, w_z, w_b, w_a = _flat_projections(c, w, p)
    x = h @ w_qkv.T  # [T, C]
    taps = w[p + "linear_attn.conv1d.weight"][:, 0, :]  # [C, K]
    width = taps.shape[1]
    conv = torch.zeros_like(x)
    for j in range(width):  # y[t] = sum_j taps[:, j] * x[t - (K - 1) + j]
        shift = width - 1 - j
        conv[shift:] += taps[:, j] * x[: total - shift]
    conv = conv * torch.sigmoid(conv)
    q, k, v = conv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
    q, k, v = q.reshape(total, kh, dk), k.reshape(total, kh, dk), v.reshape(total, vh, dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk**0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(h @ w_b.T)  # [T, Hv]
    g = -w[p + "linear_attn.A_log"].exp() * F.softplus(h @ w_a.T + w[p + "linear_attn.dt_bias"])
    group = vh // kh
    out = torch.zeros(total, vh, dv, dtype=F64)
    for head in range(vh):
        s = torch.zeros(dk, dv, dtype=F64)
        kq = head // group
        for t in range(total):
            s = s * g[t, head].exp()
            s = s + torch.outer(k[t, kq], beta[t, head] * (v[t, head] - s.T @ k[t, kq]))
            out[t, head] = s.T @ q[t, kq]
    out = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w[p + "linear_attn.norm.weight"]
    z = (h @ w_z.T).reshape(total, vh, dv)
    out = out * z * torch.sigmoid(z)
    return out.reshape(total, -1) @ w[p + "linear_attn.out_proj.weight"].T


def _attention(c: Qwen3NextConfig, w: dict[str, Tensor], p: str, h: Tensor, norm) -> Tensor:
    total, d, rot = h.shape[0], c.head_dim, c.rotary_dim
    q_gate = (h @ w[p + "self_attn.q_proj.weight"].T).view(total, c.num_heads, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:]
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(total, c.num_kv_heads, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(total, c.num_kv_heads, d)
    q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rot, 2, dtype=F64) / rot))
    angles = torch.arange(total, dtype=F64)[:, None, None] * inv_freq  # [T, 1, rot / 2]
    cos, sin = angles.cos(), angles.sin()

    def rotate(t: Tensor) -> Tensor:  # (first half, second half) pairs of the rotary dims
        a, b, rest = t[..., : rot // 2], t[..., rot // 2 : rot], t[..., rot:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)

    q, k = rotate(q).transpose(0, 1), rotate(k).transpose(0, 1)  # [heads, T, D]
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, dim=0), v.transpose(0, 1).repeat_interleave(group, dim=0)
    mask = torch.full((total, total), float("-inf"), dtype=F64).triu(1)
    attn = ((q @ k.transpose(1, 2)) / d**0.5 + mask).softmax(-1) @ v
    attn = attn.transpose(0, 1) * torch.sigmoid(gate)
    return attn.reshape(total, -1) @ w[p + "self_attn.o_proj.weight"].T


def _mlp(c: Qwen3NextConfig, w: dict[str, Tensor], p: str, routed: bool, h: Tensor) -> Tensor:
    def swiglu(prefix: str) -> Tensor:
        gate, up = h @ w[prefix + "gate_proj.weight"].T, h @ w[prefix + "up_proj.weight"].T
        return (F.silu(gate) * up) @ w[prefix + "down_proj.weight"].T

    if not routed:
        return swiglu(p + "mlp.")
    routed = moe.reference_moe(moe.MoeBlock(c.router), w, p + "mlp.", h)
    shared = swiglu(p + "mlp.shared_expert.")
    return routed + torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].T) * shared


def _norm(c: Qwen3NextConfig):
    def norm(t: Tensor, weight: Tensor) -> Tensor:  # zero-centred RMSNorm
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1.0 + weight)

    return norm


def _weights(c: Qwen3NextConfig, hf_weights: dict[str, Tensor]) -> dict[str, Tensor]:
    return {canonical_name(k): v.to(F64) for k, v in hf_weights.items() if not ignored_tensor(c, k)}


def _head(c: Qwen3NextConfig, w: dict[str, Tensor], x: Tensor) -> Tensor:
    return (x @ w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"].T).float()


def reference_forward(
    config: Qwen3NextConfig, hf_weights: dict[str, Tensor], token_ids: list[int]
) -> tuple[Tensor, Tensor]:
    """Dense, unpaged forward over Hugging Face-named weights (either layout): (logits [T, V] fp32,
    final-normed hidden states [T, hidden] fp32: what the MTP layers take)."""
    c, w, norm = config, _weights(config, hf_weights), _norm(config)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        x = x + (_attention(c, w, p, h, norm) if kind == FULL else _delta_net(c, w, p, h))
        x = x + _mlp(c, w, p, c.moe_layers[i], norm(x, w[p + "post_attention_layernorm.weight"]))
    x = norm(x, w["model.norm.weight"])
    return _head(c, w, x), x.float()


reference_logits = mtp.logits_of(reference_forward)


def reference_mtp(
    config: Qwen3NextConfig, hf_weights: dict[str, Tensor], layer: int, next_ids: list[int], hidden: Tensor
) -> tuple[Tensor, Tensor]:
    """MTP layer `layer` over a whole sequence (vLLM's Qwen3NextMultiTokenPredictor): row t joins
    next_ids[t] (the token after position t) with hidden[t] (the main model's final-normed state at
    t) and attends causally over rows <= t. Returns (logits [T, V]: the token after next_ids[t],
    MTP hidden states [T, hidden]), fp32."""
    c, w, norm = config, _weights(config, hf_weights), _norm(config)
    embedded = norm(w["model.embed_tokens.weight"][torch.tensor(next_ids)], w["mtp.pre_fc_norm_embedding.weight"])
    joined = torch.cat([embedded, norm(hidden.to(F64), w["mtp.pre_fc_norm_hidden.weight"])], dim=-1)
    x = joined @ w["mtp.fc.weight"].T
    p = f"mtp.layers.{layer}."
    x = x + _attention(c, w, p, norm(x, w[p + "input_layernorm.weight"]), norm)
    x = x + _mlp(c, w, p, c.mtp_moe, norm(x, w[p + "post_attention_layernorm.weight"]))
    x = norm(x, w["mtp.norm.weight"])
    return _head(c, w, x), x.float()
