"""A plain, unpaged DeepSeek-V4 forward over Hugging Face-named weights, for the export self-check.

Independent of the step program on purpose: float64, one dense pass over the whole sequence
(every group compressed at once, the causality of entries and windows as explicit masks), complex
rotary, experts and indexer picks chosen by sorting rather than topk.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ignition.models import moe
from ignition.models.deepseek_v3 import reference_angles
from ignition.models.deepseek_v3_config import RopeSpec
from ignition.models.deepseek_v4_config import DeepseekV4Config, canonical_name


def _norm(t: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    normed = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else weight * normed


def _rotate(t: Tensor, spec: RopeSpec, positions: Tensor, inverse: bool = False) -> Tensor:
    """Interleaved rotary on the trailing spec.dim channels of t [T, ..., D], as complex pairs."""
    angles = reference_angles(spec, int(positions.max()) + 1 if positions.numel() else 1)[positions]  # [T, r/2]
    rot = torch.polar(torch.full_like(angles, spec.cos_sin_scale), -angles if inverse else angles)
    while rot.dim() < t.dim():
        rot = rot[:, None]
    head, tail = t[..., : t.shape[-1] - spec.dim], t[..., t.shape[-1] - spec.dim :]
    pairs = torch.view_as_complex(tail.reshape(*tail.shape[:-1], spec.dim // 2, 2).contiguous())
    return torch.cat([head, torch.view_as_real(pairs * rot).flatten(-2)], dim=-1)


def _compress(
    c: DeepseekV4Config, w: dict[str, Tensor], prefix: str, h: Tensor, rate: int, overlap: bool, dim: int
) -> Tensor:
    """Every complete group of h [T, hidden] -> entries [T // rate, dim], normed and rotated at e * rate."""
    groups = h.shape[0] // rate
    width = w[prefix + "kv_proj.weight"].shape[0]
    kv = (h[: groups * rate] @ w[prefix + "kv_proj.weight"].T).view(groups, rate, width)
    gate = (h[: groups * rate] @ w[prefix + "gate_proj.weight"].T).view(groups, rate, width) + w[
        prefix + "position_bias"
    ]
    if overlap:  # entry e: group e-1 through the first dim channels, group e through the second
        previous_kv = torch.cat([torch.zeros_like(kv[:1, :, :dim]), kv[:-1, :, :dim]])
        previous_gate = torch.cat([torch.full_like(gate[:1, :, :dim], float("-inf")), gate[:-1, :, :dim]])
        kv = torch.cat([previous_kv, kv[..., dim:]], dim=1)
        gate = torch.cat([previous_gate, gate[..., dim:]], dim=1)
    pooled = (torch.softmax(gate, dim=1) * kv).sum(dim=1)
    entries = _norm(pooled, w[prefix + "kv_norm.weight"], c.rms_norm_eps)
    return _rotate(entries, c.compress_rope, torch.arange(groups) * rate)


def _attention(c: DeepseekV4Config, w: dict[str, Tensor], i: int, h: Tensor) -> Tensor:
    a = f"model.layers.{i}.self_attn."
    total, heads, dim = h.shape[0], c.num_heads, c.head_dim
    rope, positions = c.rope(i), torch.arange(total)
    q_res = _norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_norm.weight"], c.rms_norm_eps)
    q = _norm((q_res @ w[a + "q_b_proj.weight"].T).view(total, heads, dim), None, c.rms_norm_eps)
    q = _rotate(q, rope, positions)
    kv = _rotate(_norm(h @ w[a + "kv_proj.weight"].T, w[a + "kv_norm.weight"], c.rms_norm_eps), rope, positions)
    query, key = positions[:, None], positions[None, :]
    keys, visible = kv, (key <= query) & (key > query - c.sliding_window)  # [T, D], [T, T]
    rate = c.layer_rates[i]
    if rate:
        entries = _compress(c, w, a + "compressor.", h, rate, c.is_csa(i), dim)
        ready = torch.arange(entries.shape[0])[None, :] < (positions[:, None] + 1) // rate  # [T, E]
        if c.is_csa(i):
            ready = ready & _indexer_picks(c, w, a + "compressor.indexer.", h, q_res, rate, ready)
        keys, visible = torch.cat([kv, entries]), torch.cat([visible, ready], dim=1)
    scores = torch.einsum("thd,kd->thk", q, keys) * dim**-0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sinks = w[a + "sinks"][None, :, None].expand(total, heads, 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    out = _rotate(torch.einsum("thk,kd->thd", probs, keys), rope, positions, inverse=True)
    groups = out.reshape(total, c.o_groups, -1)
    w_a = w[a + "o_a_proj.weight"].view(c.o_groups, c.o_lora_rank, -1)
    return torch.einsum("tgi,gri->tgr", groups, w_a).reshape(total, -1) @ w[a + "o_b_proj.weight"].T


def _indexer_picks(
    c: DeepseekV4Config, w: dict[str, Tensor], prefix: str, h: Tensor, q_res: Tensor, rate: int, ready: Tensor
) -> Tensor:
    """[T, E] bool: the index_topk ready entries with the best indexer scores, per query."""
    total = h.shape[0]
    keys = _compress(c, w, prefix, h, rate, True, c.index_head_dim)  # [E, d]
    q = (q_res @ w[prefix + "q_b_proj.weight"].T).view(total, c.index_n_heads, c.index_head_dim)
    q = _rotate(q, c.compress_rope, torch.arange(total))
    head_weights = (h @ w[prefix + "scorer.weights_proj.weight"].T) * c.index_n_heads**-0.5  # [T, heads]
    scores = torch.einsum("thd,ed->the", q, keys).relu() * c.index_head_dim**-0.5
    scores = (scores * head_weights[:, :, None]).sum(dim=1).masked_fill(~ready, float("-inf"))
    best = scores.argsort(dim=-1, descending=True)[:, : c.index_topk]
    picked = torch.zeros_like(ready)
    picked[torch.arange(total)[:, None], best] = True
    return picked


def _hyper(c: DeepseekV4Config, w: dict[str, Tensor], prefix: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One hyper-connection: streams [T, hc, hidden] -> (post [T, hc], comb [T, hc, hc], block input [T, hidden])."""
    hc, eps = c.hc_mult, c.hc_eps
    mixes = _norm(streams.flatten(1), None, c.rms_norm_eps) @ w[prefix + "fn"].T
    scale, base = w[prefix + "scale"], w[prefix + "base"]
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax((mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
    for _ in range(c.hc_sinkhorn_iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to one
        comb = comb / (comb.sum(dim=2, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
    return post, comb, (pre[:, :, None] * streams).sum(dim=1)


def _mix(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor) -> Tensor:
    """Stream k gets post_k * out + sum_j comb[j, k] * stream j."""
    return post[:, :, None] * out[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, streams)


def reference_logits(config: DeepseekV4Config, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """Dense forward over Hugging Face-named weights: logits [T, V] (float64 arithmetic)."""
    c = config
    w = {canonical_name(k): v.double() if v.is_floating_point() else v for k, v in hf_weights.items()}
    ids = torch.tensor(token_ids)
    streams = w["model.embed_tokens.weight"][ids][:, None, :].expand(-1, c.hc_mult, -1)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        post, comb, collapsed = _hyper(c, w, p + "attn_hc.", streams)
        out = _attention(c, w, i, _norm(collapsed, w[p + "input_layernorm.weight"], c.rms_norm_eps))
        streams = _mix(post, comb, out, streams)
        post, comb, collapsed = _hyper(c, w, p + "ffn_hc.", streams)
        h = _norm(collapsed, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        chosen = w[p + "mlp.gate.tid2eid"][ids].long() if c.hash_layers[i] else None  # hash layers: by token id
        out = moe.reference_moe(moe.MoeBlock(c.router, c.activation, shared=True), w, p + "mlp.", h, ids=chosen)
        streams = _mix(post, comb, out, streams)
    flat = _norm(streams.flatten(1), None, c.rms_norm_eps) @ w["model.hc_head.hc_fn"].T
    pre = torch.sigmoid(flat * w["model.hc_head.hc_scale"] + w["model.hc_head.hc_base"]) + c.hc_eps
    x = _norm((pre[:, :, None] * streams).sum(dim=1), w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return (x @ head.T).float()
