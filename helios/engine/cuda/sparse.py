"""Triton kernels for the sparse-attention flare:: ops (block-sparse, DSA, DeepSeek-V4, GLM k-pool).

Every kernel takes one query token per program (its sequence from a device-side searchsorted
over query_start_loc); the selections are dense score rows as wide as the block table can
address, then torch.topk (or the core's shape-static select_topk) on the device.

* `_index_scores_kernel` scores the entries a query can see for the indexer ops:
  sum_h w[t, h] * relu(scale * q[t, h] . key_j), -inf where entry j is not visible. An entry is
  a cached key at position j * key_stride + key_offset (flare::indexer_topk: every position;
  flare::dsv4_indexer_topk: the slot completing compressed entry j), or (POOLED, flare::kpool_topk)
  the softmax-gated pool of positions j * pool .. j * pool + pool - 1, pooled in the kernel with
  an online softmax per channel. Entry j is visible iff j < (pos + 1) // per_entry and, given
  sequence lengths, j < seq_len // per_entry. Grid: (num_tokens, cdiv(entries, BLOCK_N)).
* `_block_scores_kernel` (flare::block_select): per indexer head, the max over a key block of the
  visible keys' scores q . k, +inf for the query's local blocks. Grid: (num_tokens, blocks).
* `_block_sparse_kernel` (flare::block_sparse_attention): flash attention over the selected key
  blocks (a block listed twice counts once), rows = a run of query heads sharing one selection
  head and one kv head. Grid: (num_tokens, num_heads // run).
* `_sparse_attention_kernel` (flare::sparse_paged_attention): flash attention over the listed key
  positions (sorted and de-duplicated on the device first), rows = one kv head's query heads.
  Grid: (num_tokens, num_kv_heads).
* flare::dsv4_pool and flare::dsv4_attention: helios.engine.cuda.deepseek_v4 (registered here).

Capturable: grids and buffers from shapes only, lengths and positions read in the kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from helios.core.ops.glm5_next import expand_selection
from helios.core.ops.sparse import select_topk
from helios.engine.cuda.deepseek_v4 import dsv4_attention, dsv4_pool
from helios.engine.cuda.tiles import (
    KV_TILE,
    paged_rows,
    pow2,
    sequences,
    softmax_result,
    softmax_start,
    softmax_step,
    token_state,
    warps,
)

ENTRY_TILE = 32  # entries scored per program (BLOCK_N of _index_scores_kernel)


def _best_first(scores: Tensor, k: int) -> Tensor:
    """The k best entries of each row of scores [..., N], best first, -1 for -inf scores and padding."""
    kept = min(k, scores.shape[-1])
    values, ids = scores.topk(kept, dim=-1)
    ids = torch.where(values == float("-inf"), -1, ids)
    return torch.nn.functional.pad(ids, (0, k - kept), value=-1)


@triton.jit
def _index_scores_kernel(
    scores,
    q,
    weights,
    cache,
    ape,
    block_tables,
    seq_lens,
    token_seq,
    positions,
    scale,
    per_entry,
    key_stride,
    key_offset,
    page_tokens,
    num_seqs,
    num_entries,
    q_tok,
    q_head,
    w_tok,
    c_page,
    c_tok,
    a_row,
    bt_row,
    s_tok,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LENS: tl.constexpr,
    POOLED: tl.constexpr,
):
    token = tl.program_id(0)
    entry = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq, pos, bound = token_state(token_seq, positions, seq_lens, token, num_seqs, HAS_LENS)
    ok = (entry < bound // per_entry) & (entry < num_entries)
    table = block_tables + seq.to(tl.int64) * bt_row
    dims = tl.arange(0, BLOCK_D)
    if POOLED:  # softmax over the pool's tokens of (gate + ape[offset]), per channel, online
        m_i = tl.full([BLOCK_N, BLOCK_D], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        keys = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for offset in range(0, per_entry):
            key_pos = entry * per_entry + offset
            key = paged_rows(cache, table, key_pos, ok, page_tokens, c_page, c_tok, 0, dims, DIM).to(tl.float32)
            gate = paged_rows(cache, table, key_pos, ok, page_tokens, c_page, c_tok, DIM, dims, DIM).to(tl.float32)
            gate += tl.load(ape + offset * a_row + dims, mask=dims < DIM, other=0.0).to(tl.float32)[None, :]
            m_new = tl.maximum(m_i, gate)
            alpha = tl.exp(m_i - m_new)
            weight = tl.exp(gate - m_new)
            l_i = l_i * alpha + weight
            keys = keys * alpha + weight * key
            m_i = m_new
        keys = keys / l_i
    else:
        key_pos = entry * key_stride + key_offset
        keys = paged_rows(cache, table, key_pos, ok, page_tokens, c_page, c_tok, 0, dims, DIM).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    query = tl.load(
        q + token * q_tok + heads[:, None] * q_head + dims[None, :],
        mask=(heads < HEADS)[:, None] & (dims < DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    weight = tl.load(weights + token * w_tok + heads, mask=heads < HEADS, other=0.0).to(tl.float32)
    per_head = tl.dot(query, tl.trans(keys), input_precision="ieee") * scale  # [heads, entries]
    total = tl.sum(tl.maximum(per_head, 0.0) * weight[:, None], 0)
    tl.store(scores + token * s_tok + entry, tl.where(ok, total, float("-inf")), mask=entry < num_entries)


def _index_scores(
    q: Tensor,
    head_weights: Tensor,
    cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor | None,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    per_entry: int,
    num_entries: int,
    key_stride: int = 1,
    key_offset: int = 0,
    ape: Tensor | None = None,
) -> Tensor:
    """[T, num_entries] fp32 indexer scores (see `_index_scores_kernel`), -inf where not visible."""
    num_tokens, heads, dim = q.shape
    scores = torch.full((num_tokens, num_entries), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_entries == 0 or block_tables.shape[0] == 0:
        return scores
    q, head_weights = q.contiguous(), head_weights.contiguous()
    grid = (num_tokens, triton.cdiv(num_entries, ENTRY_TILE))
    _index_scores_kernel[grid](
        scores,
        q,
        head_weights,
        cache,
        q if ape is None else ape,
        block_tables,
        positions if seq_lens is None else seq_lens,
        sequences(query_start_loc, num_tokens),
        positions,
        float(scale),
        per_entry,
        key_stride,
        key_offset,
        cache.shape[1],
        block_tables.shape[0],
        num_entries,
        q.stride(0),
        q.stride(1),
        head_weights.stride(0),
        cache.stride(0),
        cache.stride(1),
        0 if ape is None else ape.stride(0),
        block_tables.stride(0),
        scores.stride(0),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=pow2(heads),
        BLOCK_D=pow2(dim),
        BLOCK_N=ENTRY_TILE,
        HAS_LENS=seq_lens is not None,
        POOLED=ape is not None,
    )
    return scores


def indexer_topk(q, head_weights, k_cache, block_tables, seq_lens, query_start_loc, positions, scale, topk) -> Tensor:
    """flare::indexer_topk (helios.core.ops.sparse): kept key positions ascending, ties to the earlier."""
    positions_max = block_tables.shape[1] * k_cache.shape[1]
    scores = _index_scores(
        q, head_weights, k_cache, block_tables, seq_lens, query_start_loc, positions, scale, 1, positions_max
    )
    return select_topk(scores, scores > float("-inf"), topk)


def dsv4_indexer_topk(
    q, head_weights, key_cache, block_tables, query_start_loc, positions, rate, top_k, scale
) -> Tensor:
    """flare::dsv4_indexer_topk (helios.core.ops.deepseek_v4): complete entries' ids, best first."""
    entries = block_tables.shape[1] * key_cache.shape[1] // rate
    scores = _index_scores(
        q, head_weights, key_cache, block_tables, None, query_start_loc, positions, scale, rate, entries, rate, rate - 1
    )
    return _best_first(scores, top_k)


def kpool_topk(
    q, head_weights, cache, ape, block_tables, seq_lens, query_start_loc, positions, scale, pool, topk_pools, tail
) -> Tensor:
    """flare::kpool_topk (helios.core.ops.glm5_next): the kept pools' positions, then the query's own pool's."""
    pools = block_tables.shape[1] * cache.shape[1] // pool
    ape = ape.contiguous()
    scores = _index_scores(
        q, head_weights, cache, block_tables, seq_lens, query_start_loc, positions, scale, pool, pools, ape=ape
    )
    chosen = select_topk(scores, scores > float("-inf"), topk_pools)
    kept = expand_selection(chosen, positions, pool, tail)
    # A token of no sequence, or of one without history, keeps nothing (not even its tail).
    seqs = sequences(query_start_loc, q.shape[0]).long()
    lens = torch.cat([seq_lens, seq_lens.new_zeros(1)])  # the last for tokens past every sequence
    return torch.where((lens[seqs] > 0)[:, None], kept, -1)


@triton.jit
def _block_scores_kernel(
    out,
    q,
    k_cache,
    block_tables,
    seq_lens,
    token_seq,
    positions,
    block_size,
    local_blocks,
    page_tokens,
    num_seqs,
    q_tok,
    q_head,
    kc_page,
    kc_tok,
    bt_row,
    o_tok,
    o_head,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    block = tl.program_id(1)
    seq, pos, bound = token_state(token_seq, positions, seq_lens, token, num_seqs, True)
    table = block_tables + seq.to(tl.int64) * bt_row
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    query = tl.load(
        q + token * q_tok + heads[:, None] * q_head + dims[None, :],
        mask=(heads < HEADS)[:, None] & (dims < DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    first = block * block_size
    end = tl.minimum(first + block_size, bound)
    for start in range(first, end, BLOCK_K):
        key_pos = start + tl.arange(0, BLOCK_K)
        key_ok = key_pos < end
        keys = paged_rows(k_cache, table, key_pos, key_ok, page_tokens, kc_page, kc_tok, 0, dims, DIM)
        scores = tl.dot(query, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        best = tl.maximum(best, tl.max(tl.where(key_ok[None, :], scores, float("-inf")), 1))
    own = pos // block_size  # the query's block and the local_blocks - 1 before it always win
    local = (bound > 0) & (block <= own) & (block > own - local_blocks)
    best = tl.where(local, float("inf"), best)
    tl.store(out + token * o_tok + heads * o_head + block, best, mask=heads < HEADS)


def block_select(
    idx_q, idx_k_cache, block_tables, seq_lens, query_start_loc, positions, block_size, topk_blocks, local_blocks
) -> Tensor:
    """flare::block_select (helios.core.ops.block_sparse): each indexer head's blocks, best first."""
    num_tokens, heads, dim = idx_q.shape
    blocks = triton.cdiv(block_tables.shape[1] * idx_k_cache.shape[1], block_size)
    scores = torch.full((num_tokens, heads, blocks), float("-inf"), dtype=torch.float32, device=idx_q.device)
    if num_tokens and blocks and block_tables.shape[0]:
        idx_q = idx_q.contiguous()
        _block_scores_kernel[(num_tokens, blocks)](
            scores,
            idx_q,
            idx_k_cache,
            block_tables,
            seq_lens,
            sequences(query_start_loc, num_tokens),
            positions,
            block_size,
            local_blocks,
            idx_k_cache.shape[1],
            block_tables.shape[0],
            idx_q.stride(0),
            idx_q.stride(1),
            idx_k_cache.stride(0),
            idx_k_cache.stride(1),
            block_tables.stride(0),
            scores.stride(0),
            scores.stride(1),
            HEADS=heads,
            DIM=dim,
            BLOCK_H=pow2(heads),
            BLOCK_D=pow2(dim),
            BLOCK_K=min(KV_TILE, pow2(block_size)),
        )
    return _best_first(scores, topk_blocks)


@triton.jit
def _block_sparse_kernel(
    out,
    q,
    k_cache,
    v_cache,
    block_ids,
    block_tables,
    seq_lens,
    token_seq,
    positions,
    scale,
    block_size,
    page_tokens,
    num_seqs,
    num_picks,
    q_tok,
    q_head,
    kc_page,
    kc_tok,
    kc_head,
    vc_page,
    vc_tok,
    vc_head,
    b_tok,
    b_head,
    bt_row,
    o_tok,
    o_head,
    RUN: tl.constexpr,
    PER_SELECTION: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    token = tl.program_id(0)
    first_head = tl.program_id(1) * RUN
    selection = first_head // PER_SELECTION
    kv_head = first_head // GROUP
    seq, pos, bound = token_state(token_seq, positions, seq_lens, token, num_seqs, True)
    table = block_tables + seq.to(tl.int64) * bt_row
    rows = tl.arange(0, BLOCK_M)
    head = first_head + rows
    row_ok = rows < RUN
    dims = tl.arange(0, BLOCK_D)
    query = tl.load(q + token * q_tok + head[:, None] * q_head + dims[None, :], mask=row_ok[:, None] & (dims < DIM))
    picks = tl.arange(0, BLOCK_P)
    chosen = block_ids + token * b_tok + selection * b_head
    ids = tl.load(chosen + picks, mask=picks < num_picks, other=-1)
    m_i, l_i, acc = softmax_start(q, head, row_ok, BLOCK_M, BLOCK_D, False)
    for pick in range(0, num_picks):
        block = tl.load(chosen + pick)
        earlier = tl.sum(((ids == block) & (picks < pick)).to(tl.int32))  # listed before: counted once
        first = block * block_size
        end = tl.where((block >= 0) & (earlier == 0), tl.minimum(first + block_size, bound), first)
        for start in range(first, end, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            key_ok = key_pos < end
            keys = paged_rows(
                k_cache, table, key_pos, key_ok, page_tokens, kc_page, kc_tok, kv_head * kc_head, dims, DIM
            )
            values = paged_rows(
                v_cache, table, key_pos, key_ok, page_tokens, vc_page, vc_tok, kv_head * vc_head, dims, DIM
            )
            scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision="ieee") * scale
            scores = tl.where(key_ok[None, :] & row_ok[:, None], scores, float("-inf"))
            m_i, l_i, acc = softmax_step(scores, values.to(query.dtype), m_i, l_i, acc)
    at = out + token * o_tok + head[:, None] * o_head + dims[None, :]
    tl.store(at, softmax_result(acc, l_i).to(out.dtype.element_ty), mask=row_ok[:, None] & (dims < DIM)[None, :])


def block_sparse_attention(
    q, k_cache, v_cache, block_ids, block_tables, seq_lens, query_start_loc, positions, scale, block_size
) -> Tensor:
    """flare::block_sparse_attention (helios.core.ops.block_sparse): attention over the selected blocks."""
    num_tokens, num_heads, dim = q.shape
    out = torch.zeros_like(q)
    if num_tokens == 0 or block_tables.shape[0] == 0:
        return out
    q, block_ids = q.contiguous(), block_ids.contiguous()
    per_selection, group = num_heads // block_ids.shape[1], num_heads // k_cache.shape[2]
    run = math.gcd(per_selection, group)  # consecutive heads sharing a selection head and a kv head
    _block_sparse_kernel[(num_tokens, num_heads // run)](
        out,
        q,
        k_cache,
        v_cache,
        block_ids,
        block_tables,
        seq_lens,
        sequences(query_start_loc, num_tokens),
        positions,
        float(scale),
        block_size,
        k_cache.shape[1],
        block_tables.shape[0],
        block_ids.shape[2],
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_ids.stride(0),
        block_ids.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        RUN=run,
        PER_SELECTION=per_selection,
        GROUP=group,
        DIM=dim,
        BLOCK_M=pow2(run),
        BLOCK_D=pow2(dim),
        BLOCK_N=min(KV_TILE, pow2(block_size)),
        BLOCK_P=triton.next_power_of_2(block_ids.shape[2]),
        num_warps=warps(pow2(run), pow2(dim)),
    )
    return out


@triton.jit
def _sparse_attention_kernel(
    out,
    q,
    k_cache,
    v_cache,
    indices,
    block_tables,
    seq_lens,
    token_seq,
    positions,
    scale,
    page_tokens,
    num_seqs,
    num_indices,
    q_tok,
    q_head,
    kc_page,
    kc_tok,
    kc_head,
    vc_page,
    vc_tok,
    vc_head,
    i_tok,
    bt_row,
    o_tok,
    o_head,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, pos, bound = token_state(token_seq, positions, seq_lens, token, num_seqs, True)
    table = block_tables + seq.to(tl.int64) * bt_row
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    query = tl.load(q + token * q_tok + head[:, None] * q_head + dims[None, :], mask=row_ok[:, None] & (dims < DIM))
    m_i, l_i, acc = softmax_start(q, head, row_ok, BLOCK_M, BLOCK_D, False)
    for start in range(0, num_indices, BLOCK_N):
        listed = start + tl.arange(0, BLOCK_N)
        key_pos = tl.load(indices + token * i_tok + listed, mask=listed < num_indices, other=-1)
        key_ok = (key_pos >= 0) & (key_pos < bound)
        keys = paged_rows(k_cache, table, key_pos, key_ok, page_tokens, kc_page, kc_tok, kv_head * kc_head, dims, DIM)
        values = paged_rows(v_cache, table, key_pos, key_ok, page_tokens, vc_page, vc_tok, kv_head * vc_head, dims, DIM)
        scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision="ieee") * scale
        scores = tl.where(key_ok[None, :] & row_ok[:, None], scores, float("-inf"))
        m_i, l_i, acc = softmax_step(scores, values.to(query.dtype), m_i, l_i, acc)
    at = out + token * o_tok + head[:, None] * o_head + dims[None, :]
    tl.store(at, softmax_result(acc, l_i).to(out.dtype.element_ty), mask=row_ok[:, None] & (dims < DIM)[None, :])


def sparse_paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, topk_indices, scale
) -> Tensor:
    """flare::sparse_paged_attention (helios.core.ops.sparse): attention over each query's listed keys."""
    num_tokens, num_heads, dim = q.shape
    out = torch.zeros_like(q)
    if num_tokens == 0 or block_tables.shape[0] == 0 or topk_indices.shape[1] == 0:
        return out
    # Ascending, each key once (a key listed twice counts once): repeats become -1.
    listed = topk_indices.sort(dim=1).values
    repeat = torch.nn.functional.pad(listed[:, 1:] == listed[:, :-1], (1, 0), value=False)
    listed = torch.where(repeat, -1, listed).contiguous()
    q = q.contiguous()
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    _sparse_attention_kernel[(num_tokens, kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        listed,
        block_tables,
        seq_lens,
        sequences(query_start_loc, num_tokens),
        positions,
        float(scale),
        k_cache.shape[1],
        block_tables.shape[0],
        listed.shape[1],
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        listed.stride(0),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        DIM=dim,
        BLOCK_M=pow2(group),
        BLOCK_D=pow2(dim),
        BLOCK_N=KV_TILE,
        num_warps=warps(pow2(group), pow2(dim)),
    )
    return out


OPS = {
    "block_select": block_select,
    "block_sparse_attention": block_sparse_attention,
    "indexer_topk": indexer_topk,
    "sparse_paged_attention": sparse_paged_attention,
    "dsv4_pool": dsv4_pool,
    "dsv4_indexer_topk": dsv4_indexer_topk,
    "dsv4_attention": dsv4_attention,
    "kpool_topk": kpool_topk,
}


def register(library: torch.library.Library) -> None:
    """Install these kernels in the flare:: ops' CUDA slot."""
    for name, fn in OPS.items():
        library.impl(name, fn, "CUDA")
