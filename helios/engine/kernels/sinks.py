"""helios' CPU kernel for flare::sink_attention (packed key|value rows, optional sink logits).

The step's layout is flare::paged_attention's (helios.engine.kernels.plan plans it once per step
and window and both ops share that plan): decode rows are attended in one batched page
gather, prefill chunks per sequence, in query blocks so the score matrix stays bounded.
Grouped heads are attended as [kv_heads, group] views instead of repeating the keys. Scores,
softmax and the sink term are fp32 whatever the cache dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.engine.kernels.plan import step_plan

QUERY_BLOCK = 256  # prefill query rows scored at once: [kv_heads, group, 256, history] fp32 scores


def _weights(scores: Tensor, visible: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax over the visible keys' scores [..., Tq, S], with the sink [..., 1, 1] in the denominator."""
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    exp = (scores - top).exp()
    return exp / (exp.sum(dim=-1, keepdim=True) + (sinks - top).exp())


def _attend(query: Tensor, rows: Tensor, visible: Tensor, scale: float, sinks: Tensor | None) -> Tensor:
    """query [B, H, Tq, Dk] over rows [B, KVH, S, Dk + Dv] -> [B, H, Tq, Dv] fp32; visible broadcasts to [B, 1, 1, Tq, S]."""
    b, heads, tq, dk = query.shape
    kv_heads = rows.shape[1]
    grouped = query.float().reshape(b, kv_heads, heads // kv_heads, tq, dk)
    rows = rows.float()[:, :, None]  # [B, KVH, 1, S, Dk + Dv]
    scores = (grouped @ rows[..., :dk].transpose(-1, -2)) * scale  # [B, KVH, G, Tq, S]
    sink = None if sinks is None else sinks.float().view(1, kv_heads, heads // kv_heads, 1, 1)
    out = _weights(scores, visible, sink) @ rows[..., dk:]
    return out.reshape(b, heads, tq, -1)


def sink_attention_cpu(q, kv_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, sinks=None):
    page_tokens, kv_heads, width = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    # flare::paged_attention's gather layout (decode_pages), built once whichever op asks first
    plan = step_plan(block_tables, seq_lens, query_start_loc, positions, page_tokens, window)
    out = q.new_empty(q.shape[0], q.shape[1], width - q.shape[-1])
    if plan.decode_pages is not None:
        count = plan.decode_mask.shape[0]
        # [Bd * blocks, P, KVH, W] -> [Bd, KVH, blocks * P, W]; decode_mask [Bd, 1, 1, S] -> [Bd, 1, 1, 1, S]
        rows = kv_cache.index_select(0, plan.decode_pages).view(count, -1, kv_heads, width).transpose(1, 2)
        query = (q if plan.identity else q[plan.decode_rows])[:, :, None, :]
        decoded = _attend(query, rows, plan.decode_mask[:, None], scale, sinks)[:, :, 0].to(q.dtype)
        if plan.identity:
            return decoded
        out[plan.decode_rows] = decoded
    for part in plan.prefills:
        rows = kv_cache.index_select(0, part.pages).view(-1, kv_heads, width)[: part.kv_len].transpose(0, 1)[None]
        visible = part.visible
        if visible is None:  # the whole history, plainly causal
            visible = torch.ones(part.end - part.start, part.kv_len, dtype=torch.bool).tril()
        for start in range(part.start, part.end, QUERY_BLOCK):
            end = min(part.end, start + QUERY_BLOCK)
            query = q[start:end].transpose(0, 1)[None]  # [1, H, Tq, Dk]
            mask = visible[start - part.start : end - part.start]
            out[start:end] = _attend(query, rows, mask, scale, sinks)[0].transpose(0, 1).to(q.dtype)
    return out


def register(library: torch.library.Library) -> None:
    """Install this kernel into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("sink_attention", sink_attention_cpu, "CPU")
