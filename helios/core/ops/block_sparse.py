"""Block-sparse attention ops (MiniMax M3's Lightning indexer), part of the flare:: op set.

A sparse layer attends only to whole blocks of `block_size` keys (blocks anchored at key
position 0) that its indexer picked, separately per indexer head (one selection per group
of query heads):

* `flare::block_select` scores every visible key with the indexer's queries against the
  indexer keys cached per token (a one-head paged cache beside the KV), max-pools the scores
  per block, boosts the `local_blocks` blocks ending at the query's own to +inf, and keeps
  the `topk_blocks` best: block ids left-packed in descending score, -1 padding.
* `flare::block_sparse_attention` is causal attention restricted to those blocks.

The reference kernels are plain torch (used by ignition for export checks); helios
registers faster CPU kernels (helios.engine.kernels.block_sparse).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.attention import attend, history, sequence_rows
from helios.core.ops.fakes import like_first


def select_blocks(
    query: Tensor, keys: Tensor, query_positions: Tensor, block_size: int, topk_blocks: int, local_blocks: int
) -> Tensor:
    """The indexer's choice for queries of B sequences, as transformers' MiniMaxM3VLIndexer makes it.

    query [B, Tq, Hi, Di], keys [B, Tk, Di] (key j at position j), query_positions [B, Tq]
    -> [B, Tq, Hi, topk_blocks] int64 block ids, best first, -1 where fewer blocks are
    visible. Keys past a query's position (padding included) score -inf, so batching
    sequences of different lengths does not change any row's set of blocks.
    """
    batch, num_queries, heads, _ = query.shape
    num_keys = keys.shape[1]
    num_blocks = -(-num_keys // block_size)
    scores = torch.einsum("bqhd,bkd->bhqk", query.float(), keys.float())  # [B, Hi, Tq, Tk]
    future = torch.arange(num_keys, device=query.device)[None, None, None, :] > query_positions[:, None, :, None]
    scores = scores.masked_fill(future, float("-inf"))
    pad = num_blocks * block_size - num_keys
    if pad:
        scores = F.pad(scores, (0, pad), value=float("-inf"))
    block_scores = scores.view(batch, heads, num_queries, num_blocks, block_size).amax(dim=-1)
    if local_blocks > 0:  # the query's own block and the ones before it always win
        q_block = (query_positions // block_size)[:, None, :, None]  # [B, 1, Tq, 1]
        local = (q_block - torch.arange(local_blocks, device=query.device)).clamp(min=0)
        block_scores = block_scores.scatter(-1, local.expand(batch, heads, num_queries, local_blocks), float("inf"))
    top_scores, top_ids = block_scores.topk(min(topk_blocks, num_blocks), dim=-1)
    top_ids = top_ids.masked_fill(top_scores == float("-inf"), -1)
    if top_ids.shape[-1] < topk_blocks:
        top_ids = F.pad(top_ids, (0, topk_blocks - top_ids.shape[-1]), value=-1)
    return top_ids.permute(0, 2, 1, 3)  # [B, Tq, Hi, topk]


def block_visible(block_ids: Tensor, query_positions: Tensor, num_keys: int, block_size: int) -> Tensor:
    """[Tq, Hs, Tk] bool: key j is visible to (query, selection head) iff j <= position and
    j's block is among the query's selected blocks (block_ids [Tq, Hs, K], -1 ignored)."""
    num_blocks = -(-num_keys // block_size)
    safe = block_ids.masked_fill(block_ids < 0, num_blocks)  # -1 lands in a column dropped below
    chosen = torch.zeros(*block_ids.shape[:2], num_blocks + 1, dtype=torch.bool, device=block_ids.device)
    chosen = chosen.scatter(-1, safe, True)[..., :num_blocks]
    keep = chosen.repeat_interleave(block_size, dim=-1)[..., :num_keys]
    causal = torch.arange(num_keys, device=block_ids.device)[None, :] <= query_positions[:, None]  # [Tq, Tk]
    return keep & causal[:, None, :]


@torch.library.custom_op("flare::block_select", mutates_args=())
def block_select(
    idx_q: Tensor,
    idx_k_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
) -> Tensor:
    """The key blocks each query's indexer heads select.

    idx_q:           [num_tokens, index_heads, index_dim] (normed, rotated)
    idx_k_cache:     [num_pages, page_tokens, 1, index_dim] (already holding this step's indexer keys)
    block_tables, seq_lens, query_start_loc, positions: as flare::paged_attention
    block_size:      keys per block (blocks start at position 0)
    topk_blocks:     blocks kept per query and indexer head
    local_blocks:    blocks ending at the query's own that are always kept (within topk_blocks)
    returns          [num_tokens, index_heads, topk_blocks] int64, best first, -1 padding
    """
    out = torch.full((*idx_q.shape[:2], topk_blocks), -1, dtype=torch.int64, device=idx_q.device)
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        keys = history(idx_k_cache, block_tables[seq], kv_len)[:, 0]  # [Tk, Di]
        chosen = select_blocks(
            idx_q[start:end][None], keys[None], positions[start:end][None], block_size, topk_blocks, local_blocks
        )
        out[start:end] = chosen[0]
    return out


@block_select.register_fake
def _block_select_fake(
    idx_q, idx_k_cache, block_tables, seq_lens, query_start_loc, positions, block_size, topk_blocks, local_blocks
):
    return idx_q.new_empty((*idx_q.shape[:2], topk_blocks), dtype=torch.int64)


@torch.library.custom_op("flare::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    block_size: int,
) -> Tensor:
    """Causal attention over paged KV restricted to each query's selected key blocks.

    q:               [num_tokens, num_heads, head_dim]
    k_cache/v_cache: [num_pages, page_tokens, num_kv_heads, head_dim] (already holding this step's keys)
    block_ids:       [num_tokens, select_heads, K] int64 (flare::block_select); query head h uses
                     selection h // (num_heads / select_heads); -1 entries select nothing
    block_tables, seq_lens, query_start_loc, positions: as flare::paged_attention
    block_size:      keys per block (key j is in block j // block_size)
    returns          [num_tokens, num_heads, head_dim]
    """
    out = torch.zeros_like(q)
    num_heads, select_heads = q.shape[1], block_ids.shape[1]
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        keys = history(k_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)  # [KVH, Tk, D]
        values = history(v_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)
        visible = block_visible(block_ids[start:end], positions[start:end], kv_len, block_size)  # [Tq, Hs, Tk]
        visible = visible.repeat_interleave(num_heads // select_heads, dim=1).transpose(0, 1)  # [H, Tq, Tk]
        out[start:end] = attend(q[start:end].transpose(0, 1), keys, values, visible, scale, 0.0).transpose(0, 1)
    return out


block_sparse_attention.register_fake(like_first)
