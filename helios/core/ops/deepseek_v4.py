"""The `flare::dsv4_*` ops: DeepSeek-V4's compressed attention over per-position paged caches.

A compressed layer keeps, at every position's slot, its compressor state (the kv and gated
logits of that token) and, at the slot of the position that completes group e (the `rate`
tokens e*rate .. (e+1)*rate - 1), compressed entry e. Everything a slot holds depends only on
the tokens up to its position, so pages are shared by prefix reuse like plain KV pages.
* dsv4_pool: the softmax-gated pool of every group a query token completes (from the state);
* dsv4_indexer_topk: the Lightning indexer's top-k compressed entries per query;
* dsv4_attention: sink attention over the raw rows in a sliding window plus compressed entries.
The kernels here are plain-torch references (one query at a time); helios registers faster
ones (helios.engine.kernels.deepseek_v4). Shapes use T query tokens, P pages, S page tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.fakes import like_first


def token_sequences(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    """[T] int64: the sequence (row of block_tables) each query token belongs to."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].long(), tokens, right=True)


def slots_of(block_tables: Tensor, seq: Tensor, pos: Tensor, page_tokens: int) -> Tensor:
    """Flat cache slots of positions `pos` (>= 0, within each sequence's pages) of sequences `seq`."""
    return block_tables[seq, pos // page_tokens].long() * page_tokens + pos % page_tokens


def _rows(cache: Tensor, block_tables: Tensor, seq: int, pos: Tensor) -> Tensor:
    """[len(pos), rows * dim] cache rows of one sequence's positions."""
    flat = cache.reshape(-1, cache.shape[-2] * cache.shape[-1])
    return flat[slots_of(block_tables, torch.full_like(pos, seq), pos, cache.shape[1])]


@torch.library.custom_op("flare::dsv4_pool", mutates_args=())
def dsv4_pool(
    state_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor, positions: Tensor, rate: int, overlap: bool
) -> Tensor:
    """Compress every group a query token completes.

    state_cache:     [P, S, 1, 2 * W] per position [kv W | gate W] (position bias added), already
                     holding this step's rows; W = D, or W = 2D with `overlap`
    block_tables, query_start_loc, positions: as flare::paged_attention
    rate:            tokens per group
    overlap:         (CSA) group e pools 2 * rate slots: group e-1's positions through the first
                     halves kv[:D], gate[:D] and its own through kv[D:], gate[D:]; group 0 only its own
    returns          [T, D] fp32: for a token at p with (p + 1) % rate == 0, sum over the group's slots
                     of softmax(gate) * kv (the softmax per channel, over the slots); zeros elsewhere
    """
    width = state_cache.shape[-1] // 2
    dim = width // 2 if overlap else width
    seqs = token_sequences(query_start_loc, positions.shape[0]).tolist()
    out = torch.zeros(positions.shape[0], dim, dtype=torch.float32, device=positions.device)
    for t, p in enumerate(positions.tolist()):
        if (p + 1) % rate:
            continue
        start = p + 1 - rate
        own = _rows(state_cache, block_tables, seqs[t], torch.arange(start, p + 1)).float()
        kv, gate = own[:, :width], own[:, width:]
        if overlap:
            kv, gate = kv[:, dim:], gate[:, dim:]
            if start > 0:
                prev = _rows(state_cache, block_tables, seqs[t], torch.arange(start - rate, start)).float()
                kv = torch.cat([prev[:, :dim], kv])
                gate = torch.cat([prev[:, width : width + dim], gate])
        out[t] = (gate.softmax(dim=0) * kv).sum(dim=0)
    return out


@dsv4_pool.register_fake
def _dsv4_pool_fake(state_cache, block_tables, query_start_loc, positions, rate, overlap):
    width = state_cache.shape[-1] // 2
    return positions.new_empty((positions.shape[0], width // 2 if overlap else width), dtype=torch.float32)


@torch.library.custom_op("flare::dsv4_indexer_topk", mutates_args=())
def dsv4_indexer_topk(
    q: Tensor,
    head_weights: Tensor,
    key_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    rate: int,
    top_k: int,
    scale: float,
) -> Tensor:
    """The Lightning indexer: which compressed entries each query attends to.

    q:            [T, heads, d] indexer queries (rotated)
    head_weights: [T, heads] per-head weights of the score
    key_cache:    [P, S, 1, d] entry e's indexer key at the slot of position (e + 1) * rate - 1
    returns       [T, top_k] int64: the entries e < (p + 1) // rate (complete at the query's position p)
                  with the highest sum_h head_weights[t, h] * relu(q[t, h] . key_e) * scale, best
                  first, min(top_k, candidates) of them, then -1
    """
    seqs = token_sequences(query_start_loc, positions.shape[0]).tolist()
    out = torch.full((positions.shape[0], top_k), -1, dtype=torch.int64, device=positions.device)
    for t, p in enumerate(positions.tolist()):
        count = (p + 1) // rate
        if count == 0:
            continue
        keys = _rows(key_cache, block_tables, seqs[t], torch.arange(1, count + 1) * rate - 1).float()  # [n, d]
        scores = ((q[t].float() @ keys.T).relu() * scale * head_weights[t].float()[:, None]).sum(dim=0)
        picked = scores.topk(min(top_k, count)).indices
        out[t, : picked.shape[0]] = picked
    return out


@dsv4_indexer_topk.register_fake
def _dsv4_indexer_topk_fake(q, head_weights, key_cache, block_tables, query_start_loc, positions, rate, top_k, scale):
    return positions.new_empty((positions.shape[0], top_k), dtype=torch.int64)


@torch.library.custom_op("flare::dsv4_attention", mutates_args=())
def dsv4_attention(
    q: Tensor,
    kv_cache: Tensor,
    entry_cache: Tensor | None,
    block_tables: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    sinks: Tensor,
    scale: float,
    window: int,
    rate: int,
    selected: Tensor | None,
) -> Tensor:
    """Attention with a learned sink over rows that are keys and values alike (K = V).

    q:           [T, H, D]
    kv_cache:    [P, S, 1, D] raw rows, already holding this step's
    entry_cache: [P, S, 1, D] compressed entry e at the slot of position (e + 1) * rate - 1, or None
    sinks:       [H] per-head sink logit: in the softmax's denominator, contributing no value
    window:      raw row j is visible to a query at p iff p - window < j <= p (window >= 1)
    rate:        with an entry cache, entries e < (p + 1) // rate are visible: all of them, or
                 only those selected[t] lists ([T, K] entry ids, -1 = none)
    returns      [T, H, D] in q's dtype: sum over visible rows of softmax(q . row * scale) * row
    """
    seqs = token_sequences(query_start_loc, positions.shape[0]).tolist()
    out = torch.empty_like(q)
    for t, p in enumerate(positions.tolist()):
        rows = _rows(kv_cache, block_tables, seqs[t], torch.arange(max(0, p - window + 1), p + 1))
        if entry_cache is not None and rate > 0:
            ids = torch.arange((p + 1) // rate) if selected is None else selected[t][selected[t] >= 0].cpu()
            rows = torch.cat([rows, _rows(entry_cache, block_tables, seqs[t], (ids + 1) * rate - 1)])
        rows = rows.float()
        logits = torch.cat([q[t].float() @ rows.T * scale, sinks.float()[:, None]], dim=-1)  # [H, n + 1]
        out[t] = (logits.softmax(dim=-1)[:, :-1] @ rows).to(q.dtype)
    return out


dsv4_attention.register_fake(like_first)
