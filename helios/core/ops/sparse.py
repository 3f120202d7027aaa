"""DeepSeek Sparse Attention (DSA) ops: the lightning indexer's top-k and attention over the chosen keys.

`flare::indexer_topk` scores every key a query can see with the indexer's own small heads,
over a paged cache of indexer keys (a KvLayout.extra tensor written with flare::write_kv),
and keeps the k best; `flare::sparse_paged_attention` is flare::paged_attention restricted
to those keys. A layer that reuses another layer's selection (GLM-5's "shared" indexer
layers) passes the same indices on. The reference kernels below are plain torch over each
sequence's whole history (a dense mask); helios registers faster ones.

Selection rule (what the reference kernel and every faster kernel must return): the keys
j <= position with the k largest scores, ties at the k-th score going to the earlier key;
every visible key when fewer than k are visible. transformers' `torch.topk` over its
masked [queries, keys] rows keeps the same keys whenever no two keys tie exactly at the
k-th score; for exact ties it has no fixed order (it differs with the row's length, so its
own full forward and its cached decode can disagree), which is why the op fixes one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import attend, history, sequence_rows, visible_keys
from helios.core.ops.fakes import like_first


@torch.library.custom_op("flare::indexer_topk", mutates_args=())
def indexer_topk(
    q: Tensor,
    head_weights: Tensor,
    k_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    topk: int,
) -> Tensor:
    """The top-k keys of each query by the indexer's score.

    q:               [num_tokens, index_heads, index_dim] indexer queries (fp32)
    head_weights:    [num_tokens, index_heads] fp32, each head's weight for its query (fully scaled)
    k_cache:         [num_pages, page_tokens, 1, index_dim] indexer keys (already holding this step's)
    block_tables, seq_lens, query_start_loc, positions: as flare::paged_attention
    scale:           multiplies q . k before the ReLU
    topk:            keys kept per query (>= 1)
    returns          [num_tokens, topk] int64: positions (within the query's sequence) of the kept
                     keys in ascending order, then -1 where fewer than topk keys are visible.
                     score(t, j) = sum_h head_weights[t, h] * relu(scale * q[t, h] . k[j]); see the
                     module docstring for the selection rule.
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        keys = history(k_cache, block_tables[seq], kv_len)[:, 0]  # [S, D]
        scores = index_scores(q[start:end], head_weights[start:end], keys, scale)
        visible = visible_keys(torch.arange(kv_len, device=q.device), positions[start:end], 0)
        out[start:end] = select_topk(scores, visible, topk)
    return out


@indexer_topk.register_fake
def _indexer_topk_fake(q, head_weights, k_cache, block_tables, seq_lens, query_start_loc, positions, scale, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)


@torch.library.custom_op("flare::sparse_paged_attention", mutates_args=())
def sparse_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    topk_indices: Tensor,
    scale: float,
) -> Tensor:
    """flare::paged_attention of each query over only its selected keys.

    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions: as flare::paged_attention
    topk_indices:    [num_tokens, k] int64 key positions within the query's sequence (flare::indexer_topk);
                     -1 = no key; a position the query cannot see (> its position) is ignored, and
                     one listed twice counts once
    returns          [num_tokens, num_heads, head_dim]; a query left with no key gets zeros
    """
    out = torch.zeros_like(q)
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        keys = history(k_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)  # [KVH, S, D]
        values = history(v_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)
        chosen = selected_keys(topk_indices[start:end], kv_len)
        chosen &= visible_keys(torch.arange(kv_len, device=q.device), positions[start:end], 0)
        attn = attend(q[start:end].transpose(0, 1), keys, values, chosen, scale, 0.0)  # [H, Tq, D]
        attn = torch.where(chosen.any(-1)[None, :, None], attn, 0.0)  # SDPA gives NaN for a row without keys
        out[start:end] = attn.transpose(0, 1)
    return out


sparse_paged_attention.register_fake(like_first)


# ---------------------------------------------------------------------------- shared pieces


def index_scores(q: Tensor, head_weights: Tensor, keys: Tensor, scale: float) -> Tensor:
    """q [..., Tq, H, D], head_weights [..., Tq, H], keys [..., S, D] -> scores [..., Tq, S] fp32,
    in transformers' order: fp32 q . k per head, times scale, ReLU, then the heads' weighted sum."""
    per_head = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(-3)) * scale  # [..., Tq, H, S]
    return torch.matmul(head_weights.float().unsqueeze(-2), per_head.relu()).squeeze(-2)


def select_topk(scores: Tensor, visible: Tensor, k: int) -> Tensor:
    """scores [R, S] and visible [R, S] bool -> [R, k] int64: the selection rule's kept key
    positions, ascending, -1 padded (see the module docstring)."""
    rows, total = scores.shape
    kept = min(k, total)
    if kept == 0:
        return torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    kth = scores.topk(kept, dim=-1).values[:, -1:]  # [R, 1]; -inf when fewer than `kept` are visible
    above = (scores > kth) & visible
    tied = (scores == kth) & visible
    room = kept - above.sum(-1, keepdim=True)
    keep = above | (tied & (tied.cumsum(-1) <= room))  # the earliest ties fill the remaining places
    # Ascending positions: each kept key goes to its rank among the kept; the rest to a spare column.
    column = torch.where(keep, keep.cumsum(-1) - 1, kept)
    out = torch.full((rows, kept + 1), -1, dtype=torch.int64, device=scores.device)
    out.scatter_(1, column, torch.arange(total, device=scores.device).expand(rows, total))
    out = out[:, :kept]  # columns past a row's kept count were never written: -1
    return out if kept == k else torch.cat([out, out.new_full((rows, k - kept), -1)], dim=1)


def selected_keys(indices: Tensor, total: int) -> Tensor:
    """[R, k] key positions (-1 = none) -> [R, total] bool mask of the selected keys."""
    column = torch.where((indices >= 0) & (indices < total), indices, total)
    mask = torch.zeros(indices.shape[0], total + 1, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, column, True)[:, :total]
