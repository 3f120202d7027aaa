"""GLM-5.3-Flash's (transformers' glm5_next) two ops the existing ones cannot express.

`flare::kda`: Kimi Delta Attention, the gated delta rule with a forget gate per KEY CHANNEL
(flare::gated_delta_rule decays a whole head by one scalar). Per head, with state S [Dk, Dv],
for each token t in order:
    S <- diag(exp(g_t)) S                              (decay per key channel, g_t [Dk] <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          (delta-rule write of the correction)
    o_t = S^T (scale * q_t)
with q_t, k_t L2-normalized first when `qk_l2norm` (transformers' `l2norm`, eps 1e-6 inside
the square root). State slots follow the recurrent-state convention (helios.core.ops.recurrent):
a sequence at position 0 starts from zero state, any other reads its slot, and the slot ends
holding the state after the sequence's last row, whatever the chunk length (1 = decode).

`flare::kpool_topk`: the k-pool DSA indexer's selection. Keys are scored per POOL of `pool`
consecutive positions (0..pool-1, pool..2*pool-1, ...): a complete pool's key is the per-channel
softmax-weighted mean of its tokens' indexer keys, weights softmax over the pool's tokens of
(gate logit + ape[offset in pool]). A query at position p scores the complete pools that end at
or before p as sum_h head_weights[h] * relu(scale * q_h . pool_key), keeps the `topk_pools`
best (ties at the k-th score to the earlier pool, as flare::indexer_topk), expands them to their
positions, and (`tail`) adds the positions of its own incomplete pool, p - (p + 1) % pool + 1 .. p.

The reference kernels below are plain torch, one sequence (and for kda one token) at a time;
helios registers faster CPU ones (helios.engine.kernels.glm5_next).
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import history, sequence_rows
from helios.core.ops.gated_delta import delta_rule_fake, delta_rule_op
from helios.core.ops.sparse import index_scores, select_topk

# flare::kda has flare::gated_delta_rule's schema and reference body (delta_rule_op): only its
# gate differs, g [num_tokens, num_heads, k_dim] (one decay per key channel), which the shared
# recurrence broadcasts over the state; its value heads equal its key heads.
kda = torch.library.custom_op("flare::kda", mutates_args=("state",))(delta_rule_op)
kda.register_fake(delta_rule_fake)


def kpool_width(pool: int, topk_pools: int, tail: bool) -> int:
    """Columns flare::kpool_topk returns: the selected pools' positions, then the tail's."""
    return topk_pools * pool + (pool - 1 if tail else 0)


def pooled_keys(rows: Tensor, ape: Tensor, pool: int) -> Tensor:
    """One sequence's indexer rows [S, 2D] ([key | gate logits] per position) -> the keys of its
    complete pools [S // pool, D] fp32 (per channel, softmax over the pool's tokens of gate + ape)."""
    dim = ape.shape[1]
    count = rows.shape[0] // pool
    grouped = rows[: count * pool].float().view(count, pool, 2 * dim)
    keys, gates = grouped[..., :dim], grouped[..., dim:]
    weights = (gates + ape.float()[None]).softmax(dim=1)
    return (weights * keys).sum(dim=1)


def expand_selection(chosen: Tensor, query_positions: Tensor, pool: int, tail: bool) -> Tensor:
    """chosen pools [R, k] (-1 = none) and the queries' positions [R] -> [R, kpool_width] int64 positions."""
    offsets = torch.arange(pool, device=chosen.device)
    tokens = torch.where(chosen[..., None] >= 0, chosen[..., None] * pool + offsets, -1).flatten(1)
    if not tail or pool == 1:
        return tokens
    count = (query_positions + 1) % pool  # tokens of the query's own incomplete pool
    first = query_positions + 1 - count
    tail_offsets = torch.arange(pool - 1, device=chosen.device)
    tails = torch.where(tail_offsets[None] < count[:, None], first[:, None] + tail_offsets[None], -1)
    return torch.cat([tokens, tails], dim=1)


def select_pools(
    q: Tensor,
    head_weights: Tensor,
    rows: Tensor,
    ape: Tensor,
    query_positions: Tensor,
    scale: float,
    pool: int,
    topk_pools: int,
    tail: bool,
) -> Tensor:
    """One sequence's queries [R, H, D] against its indexer rows [S, 2D] -> [R, kpool_width] positions."""
    keys = pooled_keys(rows, ape, pool)  # [P, D]
    scores = index_scores(q, head_weights, keys, scale)  # [R, P]
    ends = torch.arange(keys.shape[0], device=q.device) * pool + pool - 1
    visible = ends[None, :] <= query_positions[:, None]
    chosen = select_topk(scores, visible, topk_pools)
    return expand_selection(chosen, query_positions, pool, tail)


@torch.library.custom_op("flare::kpool_topk", mutates_args=())
def kpool_topk(
    q: Tensor,
    head_weights: Tensor,
    cache: Tensor,
    ape: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    pool: int,
    topk_pools: int,
    tail: bool,
) -> Tensor:
    """The k-pool indexer's kept positions per query (see the module docstring).

    q, head_weights: as flare::indexer_topk (the indexer's queries and their heads' weights)
    cache:           [num_pages, page_tokens, 1, 2 * index_dim] per position: its indexer key, then
                     its gate logits (already holding this step's rows)
    ape:             [pool, index_dim] the gate's bias per offset in the pool
    block_tables, seq_lens, query_start_loc, positions: as flare::paged_attention
    scale:           multiplies q . k before the ReLU
    pool, topk_pools, tail: tokens per pool, pools kept per query, whether the query's incomplete
                     pool is always kept
    returns          [num_tokens, kpool_width(pool, topk_pools, tail)] int64 positions within the
                     query's sequence, -1 = none (for flare::sparse_paged_attention)
    """
    width = kpool_width(pool, topk_pools, tail)
    out = torch.full((q.shape[0], width), -1, dtype=torch.int64, device=q.device)
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        rows = history(cache, block_tables[seq], kv_len)[:, 0]  # [S, 2D]
        out[start:end] = select_pools(
            q[start:end], head_weights[start:end], rows, ape, positions[start:end], scale, pool, topk_pools, tail
        )
    return out


@kpool_topk.register_fake
def _kpool_topk_fake(
    q, head_weights, cache, ape, block_tables, seq_lens, query_start_loc, positions, scale, pool, topk_pools, tail
):
    return q.new_empty((q.shape[0], kpool_width(pool, topk_pools, tail)), dtype=torch.int64)
