"""helios' CPU kernels for the flare::dsv4_* ops (DeepSeek-V4's compressed attention).

The reference ops handle one query token at a time. Here every completed group of a step is
pooled in one gather, and the indexer and attention run once per sequence of the step: its
window of raw rows and its compressed entries are gathered once for all of its query rows and
scored under a mask. The step's layout (each token's sequence, each sequence's rows) is planned
once per step and shared by every compressed layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from helios.core.ops.deepseek_v4 import slots_of, token_sequences
from helios.engine.kernels.memo import StepMemo


@dataclass(frozen=True, slots=True)
class _Span:
    seq: int  # row of block_tables
    start: int  # query rows [start, end) of the step
    end: int
    first: int  # positions of its first and last query
    last: int


@dataclass(frozen=True, slots=True)
class _Plan:
    seqs: Tensor  # [T] the sequence of each query token
    spans: tuple[_Span, ...]  # sequences with queries in this step


_plans: StepMemo[_Plan] = StepMemo()


def _plan(query_start_loc: Tensor, positions: Tensor) -> _Plan:
    def build() -> _Plan:
        starts = query_start_loc.tolist()
        spans = []
        for seq in range(len(starts) - 1):
            start, end = starts[seq], starts[seq + 1]
            if end > start:
                window = positions[start:end]
                spans.append(_Span(seq, start, end, int(window.min()), int(window.max())))
        return _Plan(token_sequences(query_start_loc, positions.shape[0]), tuple(spans))

    return _plans.get((query_start_loc, positions), build)


def _entry_slots(block_tables: Tensor, seq: int, count: int, rate: int, page_tokens: int) -> Tensor:
    """Slots of entries 0..count-1 of a sequence (each at the position completing its group)."""
    pos = torch.arange(1, count + 1) * rate - 1
    return slots_of(block_tables, torch.full_like(pos, seq), pos, page_tokens)


def pool_cpu(
    state_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor, positions: Tensor, rate: int, overlap: bool
) -> Tensor:
    width = state_cache.shape[-1] // 2
    dim = width // 2 if overlap else width
    out = torch.zeros(positions.shape[0], dim, dtype=torch.float32)
    done = ((positions + 1) % rate == 0).nonzero()[:, 0]
    if done.numel() == 0:
        return out
    seqs = _plan(query_start_loc, positions).seqs[done]
    span = 2 * rate if overlap else rate
    grid = positions[done][:, None] - span + 1 + torch.arange(span)[None, :]  # [N, span] positions pooled
    flat = state_cache.view(-1, state_cache.shape[-1])
    rows = flat[slots_of(block_tables, seqs[:, None], grid.clamp(min=0), state_cache.shape[1])].float()
    if overlap:  # the previous group's first halves, then this group's second halves
        kv = torch.cat([rows[:, :rate, :dim], rows[:, rate:, dim:width]], dim=1)
        gate = torch.cat([rows[:, :rate, width : width + dim], rows[:, rate:, width + dim :]], dim=1)
        gate = gate.masked_fill((grid < 0)[:, :, None], float("-inf"))  # group 0 has no previous group
    else:
        kv, gate = rows[..., :width], rows[..., width:]
    out[done] = (gate.softmax(dim=1) * kv).sum(dim=1)
    return out


def indexer_topk_cpu(
    q, head_weights, key_cache, block_tables, query_start_loc, positions, rate, top_k, scale
) -> Tensor:
    """flare::dsv4_indexer_topk (arguments as its schema: helios.core.ops.deepseek_v4)."""
    out = torch.full((positions.shape[0], top_k), -1, dtype=torch.int64)
    flat = key_cache.view(-1, key_cache.shape[-1])
    for span in _plan(query_start_loc, positions).spans:
        count = (span.last + 1) // rate
        if count == 0:
            continue
        keys = flat[_entry_slots(block_tables, span.seq, count, rate, key_cache.shape[1])].float()  # [n, d]
        rows = slice(span.start, span.end)
        ready = (positions[rows] + 1) // rate  # [Tq] entries complete at each query
        scores = torch.matmul(q[rows].float(), keys.T).relu() * scale  # [Tq, heads, n]
        scores = (scores * head_weights[rows].float()[:, :, None]).sum(dim=1)
        scores = scores.masked_fill(torch.arange(count)[None, :] >= ready[:, None], float("-inf"))
        picked = scores.topk(min(top_k, count), dim=-1).indices
        out[rows, : picked.shape[1]] = torch.where(picked < ready[:, None], picked, -1)
    return out


def attention_cpu(
    q, kv_cache, entry_cache, block_tables, query_start_loc, positions, sinks, scale, window, rate, selected
) -> Tensor:
    """flare::dsv4_attention (arguments as its schema: helios.core.ops.deepseek_v4)."""
    out = torch.empty_like(q)
    page_tokens, dim = kv_cache.shape[1], kv_cache.shape[-1]
    flat = kv_cache.view(-1, dim)
    sink = sinks.float()[None, :, None]
    for span in _plan(query_start_loc, positions).spans:
        rows = slice(span.start, span.end)
        pos = positions[rows]
        raw = torch.arange(max(0, span.first - window + 1), span.last + 1)
        keys = flat[slots_of(block_tables, torch.full_like(raw, span.seq), raw, page_tokens)]
        visible = (raw[None, :] <= pos[:, None]) & (raw[None, :] > pos[:, None] - window)  # [Tq, raw]
        count = (span.last + 1) // rate if entry_cache is not None and rate > 0 else 0
        if count:
            entries = entry_cache.view(-1, dim)[_entry_slots(block_tables, span.seq, count, rate, page_tokens)]
            if selected is None:
                ready = torch.arange(count)[None, :] < (pos[:, None] + 1) // rate
            else:  # the indexer's picks (-1: none) as a mask over the entries
                picks = selected[rows]
                ready = torch.zeros(pos.shape[0], count + 1, dtype=torch.bool)
                ready = ready.scatter_(1, torch.where(picks >= 0, picks, count), True)[:, :count]
            keys, visible = torch.cat([keys, entries]), torch.cat([visible, ready], dim=1)
        keys = keys.float()
        logits = torch.matmul(q[rows].float(), keys.T) * scale  # [Tq, H, n]
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        logits = torch.cat([logits, sink.expand(logits.shape[0], -1, 1)], dim=-1)
        out[rows] = torch.matmul(logits.softmax(dim=-1)[..., :-1], keys).to(q.dtype)
    return out


def register(library: torch.library.Library) -> None:
    """Install these kernels into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("dsv4_pool", pool_cpu, "CPU")
    library.impl("dsv4_indexer_topk", indexer_topk_cpu, "CPU")
    library.impl("dsv4_attention", attention_cpu, "CPU")
