"""The glm5_next family's plain-torch reference forward (the export self-check's), over Hugging
Face-named weights and the whole sequence at once, in float64.

Independent of the step program's formulation where it can be: KDA as the per-token recurrence
(no chunked form, no state slots), the conv as an explicit sum, the k-pool indexer densely over
all pools with a stable sort (ties to the earlier pool, the ops' rule), non-absorbed MLA under a
mask of the selected positions (kv_b_proj expands every head's keys and values), the routed
experts by sorting (moe.reference_moe), and DeepSeek-V4's reference hyper-connections
(deepseek_v4_reference: the same mHC arithmetic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import moe
from ignition.models.deepseek_v4_reference import _hyper, _mix, _norm
from ignition.models.family import PromptImages
from ignition.models.glm5_next_config import _FLAT_PREFIX, _TEXT_PREFIX, INDEXED, Glm5NextConfig
from ignition.models.glm_moe_dsa import INDEXER_NORM_EPS


def _canonical(name: str) -> str:
    """A text tensor's name with the "model." prefix (the flat layout), whichever layout it came in."""
    return _FLAT_PREFIX + name[len(_TEXT_PREFIX) :] if name.startswith(_TEXT_PREFIX) else name


def _kda(c: Glm5NextConfig, w: dict[str, Tensor], a: str, h: Tensor) -> Tensor:
    """A KDA block under `a` ("model.layers.N.self_attn.") over h [T, hidden] -> [T, hidden]."""
    total, heads, dim, width = h.shape[0], c.linear_num_heads, c.linear_head_dim, c.conv_kernel_size
    mixed = torch.cat([h @ w[a + "q_proj.weight"].T, h @ w[a + "k_proj.weight"].T, h @ w[a + "v_proj.weight"].T], -1)
    if a + "conv1d.weight" in w:
        kernel = w[a + "conv1d.weight"][:, 0]  # [C, K]
    else:
        kernel = torch.cat([w[a + f"{part}_conv1d.weight"] for part in "qkv"])[:, 0]
    padded = torch.cat([mixed.new_zeros(width - 1, mixed.shape[1]), mixed])
    conv = sum(padded[j : j + total] * kernel[:, j] for j in range(width))
    q, k, v = (conv * torch.sigmoid(conv)).view(total, 3, heads, dim).unbind(1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dim**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)

    def gate_part(name: str) -> Tensor:  # transformers' forget_gate.* or GLM's names directly under self_attn
        return w[a + "forget_gate." + name] if a + "forget_gate." + name in w else w[a + name]

    f_a, f_b, dt, a_log = (gate_part(n) for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"))
    gate = ((h @ f_a.T @ f_b.T) + dt).view(total, heads, dim)
    rate = a_log.exp()[:, None]
    if c.linear_lower_bound is not None:
        log_decay = c.linear_lower_bound / (1 + torch.exp(-rate * gate))
    else:
        log_decay = -rate * torch.where(gate > 20, gate, torch.log1p(gate.exp()))
    beta = 1 / (1 + torch.exp(-(h @ w[a + "b_proj.weight"].T)))
    state = h.new_zeros(heads, dim, dim)
    out = h.new_zeros(total, heads, dim)
    for t in range(total):
        state = state * log_decay[t].exp()[:, :, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + torch.einsum("hk,hv->hkv", k[t], delta)
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    out = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w[a + "o_norm.weight"]
    out = out / (1 + torch.exp(-(h @ w[a + "g_a_proj.weight"].T @ w[a + "g_b_proj.weight"].T).view(total, heads, dim)))
    return out.reshape(total, -1) @ w[a + "o_proj.weight"].T


def _selection(c: Glm5NextConfig, w: dict[str, Tensor], x: str, h: Tensor, q_resid: Tensor) -> Tensor:
    """The k-pool indexer under `x` ("...self_attn.indexer."): [T, T] bool, position j kept for query i."""
    total, heads, dim, pool = h.shape[0], c.index_n_heads, c.index_head_dim, c.index_kpool
    q = (q_resid @ w[x + "wq_b.weight"].T).view(total, heads, dim)
    k = F.layer_norm(h @ w[x + "wk.weight"].T, (dim,), w[x + "k_norm.weight"], w[x + "k_norm.bias"], INDEXER_NORM_EPS)
    gates = h @ w[x + "index_kpool_compress_gate"].T
    count = total // pool
    logits = gates[: count * pool].view(count, pool, dim) + w[x + "index_kpool_compress_ape"][None]
    pooled = (logits.softmax(dim=1) * k[: count * pool].view(count, pool, dim)).sum(1)  # [P, D]
    per_head = torch.einsum("thd,pd->thp", q, pooled) * dim**-0.5
    scores = torch.einsum("th,thp->tp", (h @ w[x + "weights_proj.weight"].T) * heads**-0.5, per_head.clamp(min=0))
    positions = torch.arange(total)
    visible = (torch.arange(count) * pool + pool - 1)[None, :] <= positions[:, None]  # [T, P]
    order = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(count).expand(total, count))
    kept_pools = visible & (ranks < c.index_topk // pool)  # [T, P]
    kept = torch.zeros(total, total, dtype=torch.bool)
    kept[:, : count * pool] = kept_pools.repeat_interleave(pool, dim=1)
    if c.index_tail:  # the query's own incomplete pool
        first = positions - (positions + 1) % pool + 1
        kept |= (positions[None, :] >= first[:, None]) & (positions[None, :] <= positions[:, None])
    return kept & (positions[None, :] <= positions[:, None])


def _mla(c: Glm5NextConfig, w: dict[str, Tensor], a: str, h: Tensor, q_resid: Tensor, kept: Tensor) -> Tensor:
    """Non-absorbed NoPE MLA under `a` over the kept positions: h [T, hidden] -> [T, hidden]."""
    total, heads = h.shape[0], c.num_heads
    q = (q_resid @ w[a + "q_b_proj.weight"].T).view(total, heads, c.qk_nope_head_dim).transpose(0, 1)
    c_kv = _norm(h @ w[a + "kv_a_proj_with_mqa.weight"].T, w[a + "kv_a_layernorm.weight"], c.rms_norm_eps)
    expanded = (c_kv @ w[a + "kv_b_proj.weight"].T).view(total, heads, -1).transpose(0, 1)
    k, v = expanded[..., : c.qk_nope_head_dim], expanded[..., c.qk_nope_head_dim :]
    scores = (q @ k.transpose(1, 2)) * c.softmax_scale
    scores = scores.masked_fill(~kept[None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(total, -1) @ w[a + "o_proj.weight"].T


def _dense(c: Glm5NextConfig, w: dict[str, Tensor], m: str, h: Tensor) -> Tensor:
    limit = c.activation.limit
    gate = (h @ w[m + "gate_proj.weight"].T).clamp(max=limit)
    up = (h @ w[m + "up_proj.weight"].T).clamp(-limit, limit)
    return (gate * torch.sigmoid(gate) * up) @ w[m + "down_proj.weight"].T


def reference_logits(
    config: Glm5NextConfig, hf_weights: dict[str, Tensor], token_ids: list[int], images: PromptImages | None = None
) -> Tensor:
    """Dense forward over Hugging Face-named weights: logits [T, V] (float64 arithmetic). The
    prompt's `images` replace their positions' input embeddings."""
    c = config
    w = {_canonical(k): v.double() if v.is_floating_point() else v for k, v in hf_weights.items()}
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]  # a copy (advanced indexing)
    if images is not None:
        images.splice(x)
    streams = x[:, None, :].expand(-1, c.hc_mult, -1)
    kept: Tensor | None = None
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        hc = {part: w.get(f"{p}attn_hc.{part}", w.get(f"{p}hc_attn_{part}")) for part in ("fn", "base", "scale")}
        post, comb, collapsed = _hyper(c, {f"{p}attn_hc.{k}": v for k, v in hc.items()}, p + "attn_hc.", streams)
        h = _norm(collapsed, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        if kind == INDEXED:
            q_resid = _norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], c.rms_norm_eps)
            if c.indexer_types[i] == "full":
                kept = _selection(c, w, a + "indexer.", h, q_resid)
            assert kept is not None
            out = _mla(c, w, a, h, q_resid, kept)
        else:
            out = _kda(c, w, a, h)
        streams = _mix(post, comb, out, streams)
        hc = {part: w.get(f"{p}ffn_hc.{part}", w.get(f"{p}hc_ffn_{part}")) for part in ("fn", "base", "scale")}
        post, comb, collapsed = _hyper(c, {f"{p}ffn_hc.{k}": v for k, v in hc.items()}, p + "ffn_hc.", streams)
        h = _norm(collapsed, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        if c.is_moe(i):
            out = moe.reference_moe(c.moe_block, w, p + "mlp.", h)
        else:
            out = _dense(c, w, p + "mlp.", h)
        streams = _mix(post, comb, out, streams)
    x = _norm(streams.mean(dim=1), w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return (x @ head.T).float()
