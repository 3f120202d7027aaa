"""Triton kernels for the sparse-attention flare:: ops (block-sparse, DSA, DeepSeek-V4, GLM k-pool).

Every kernel takes one query token per program (its sequence from a device-side searchsorted
over query_start_loc, in the step's `Paged` layout); the selections are dense score rows as wide as the block table can
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
* `_listed_attention_kernel`: flash attention of one query token over the keys a list names,
  rows = a run of query heads sharing one kv head (and one selection head). Grid: (num_tokens,
  num_heads // run). It serves flare::block_sparse_attention (BLOCKS: the selected key blocks, a
  block listed twice counted once; run = the heads sharing a selection head and a kv head) and
  flare::sparse_paged_attention (the listed key positions, sorted and de-duplicated on the device
  first; run = one kv head's query heads).
* flare::dsv4_pool and flare::dsv4_attention: helios.engine.cuda.deepseek_v4 (registered here).

Capturable: grids and buffers from shapes only, lengths and positions read in the kernels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from helios.core.ops.glm5_next import expand_selection
from helios.core.ops.sparse import select_topk
from helios.engine.cuda import tiles
from helios.engine.cuda.deepseek_v4 import dsv4_attention, dsv4_pool

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
    paged,
    scale,
    entries,
    q_strides,
    c_strides,
    w_tok,
    a_row,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LENS: tl.constexpr,
    POOLED: tl.constexpr,
):
    token, seq, pos, bound, table = tiles.token_state(paged, HAS_LENS)
    entry = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (entry < bound // entries.per_entry) & (entry < entries.count)
    dims = tl.arange(0, BLOCK_D)
    if POOLED:  # softmax over the pool's tokens of (gate + ape[offset]), per channel, online
        m_i = tl.full([BLOCK_N, BLOCK_D], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        keys = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for offset in range(0, entries.per_entry):
            key_pos = entry * entries.per_entry + offset
            key = tiles.paged_rows(cache, c_strides, paged, table, key_pos, ok, 0, dims, DIM).to(tl.float32)
            gate = tiles.paged_rows(cache, c_strides, paged, table, key_pos, ok, DIM, dims, DIM).to(tl.float32)
            gate += tl.load(ape + offset * a_row + dims, mask=dims < DIM, other=0.0).to(tl.float32)[None, :]
            m_new = tl.maximum(m_i, gate)
            alpha = tl.exp(m_i - m_new)
            weight = tl.exp(gate - m_new)
            l_i = l_i * alpha + weight
            keys = keys * alpha + weight * key
            m_i = m_new
        keys = keys / l_i
    else:
        key_pos = entry * entries.key_stride + entries.key_offset
        keys = tiles.paged_rows(cache, c_strides, paged, table, key_pos, ok, 0, dims, DIM).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    at, mask = tiles.token_rows(q, q_strides, token, heads, heads < HEADS, dims, DIM)
    query = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weights + token * w_tok + heads, mask=heads < HEADS, other=0.0).to(tl.float32)
    per_head = tl.dot(query, tl.trans(keys), input_precision="ieee") * scale  # [heads, entries]
    total = tl.sum(tl.maximum(per_head, 0.0) * weight[:, None], 0)
    tl.store(scores + token * entries.count + entry, tl.where(ok, total, float("-inf")), mask=entry < entries.count)


class Entries(NamedTuple):
    """What `_index_scores_kernel` scores (one kernel argument): `count` entries, entry j visible
    from position (j + 1) * per_entry - 1 on, its key at position j * key_stride + key_offset (or,
    pooled, the pool of positions j * per_entry .. j * per_entry + per_entry - 1)."""

    count: int
    per_entry: int
    key_stride: int = 1
    key_offset: int = 0


def _index_scores(q, head_weights, cache, layout: tiles.Paged, scale: float, entries: Entries, ape=None) -> Tensor:
    """[T, entries.count] fp32 indexer scores (see `_index_scores_kernel`), -inf where not visible."""
    num_tokens, heads, dim = q.shape
    # contiguous: the kernel takes rows entries.count apart
    scores = torch.full((num_tokens, entries.count), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or entries.count == 0 or layout.num_seqs == 0:
        return scores
    q, head_weights = q.contiguous(), head_weights.contiguous()
    grid = (num_tokens, triton.cdiv(entries.count, ENTRY_TILE))
    strides = (q.stride()[:2], cache.stride()[:2], head_weights.stride(0), 0 if ape is None else ape.stride(0))
    blocks = {"BLOCK_H": tiles.pow2(heads), "BLOCK_D": tiles.pow2(dim), "BLOCK_N": ENTRY_TILE}
    # layout_of() stands the positions in for lengths an op does not have
    flags = {"HAS_LENS": layout.seq_lens is not layout.positions, "POOLED": ape is not None}
    tensors = (scores, q, head_weights, cache, q if ape is None else ape, layout)
    _index_scores_kernel[grid](*tensors, float(scale), entries, *strides, HEADS=heads, DIM=dim, **blocks, **flags)
    return scores


def indexer_topk(q, head_weights, k_cache, block_tables, seq_lens, query_start_loc, positions, scale, topk) -> Tensor:
    """flare::indexer_topk (helios.core.ops.sparse): kept key positions ascending, ties to the earlier."""
    layout = tiles.layout_of(block_tables, seq_lens, query_start_loc, positions, k_cache.shape[1])
    scores = _index_scores(
        q, head_weights, k_cache, layout, scale, Entries(block_tables.shape[1] * k_cache.shape[1], 1)
    )
    return select_topk(scores, scores > float("-inf"), topk)


def dsv4_indexer_topk(
    q, head_weights, key_cache, block_tables, query_start_loc, positions, rate, top_k, scale
) -> Tensor:
    """flare::dsv4_indexer_topk (helios.core.ops.deepseek_v4): complete entries' ids, best first."""
    entries = Entries(block_tables.shape[1] * key_cache.shape[1] // rate, rate, rate, rate - 1)
    layout = tiles.layout_of(block_tables, None, query_start_loc, positions, key_cache.shape[1])
    scores = _index_scores(q, head_weights, key_cache, layout, scale, entries)
    return _best_first(scores, top_k)


def kpool_topk(
    q, head_weights, cache, ape, block_tables, seq_lens, query_start_loc, positions, scale, pool, topk_pools, tail
) -> Tensor:
    """flare::kpool_topk (helios.core.ops.glm5_next): the kept pools' positions, then the query's own pool's."""
    pools = Entries(block_tables.shape[1] * cache.shape[1] // pool, pool)
    layout = tiles.layout_of(block_tables, seq_lens, query_start_loc, positions, cache.shape[1])
    scores = _index_scores(q, head_weights, cache, layout, scale, pools, ape.contiguous())
    chosen = select_topk(scores, scores > float("-inf"), topk_pools)
    kept = expand_selection(chosen, positions, pool, tail)
    # A token of no sequence, or of one without history, keeps nothing (not even its tail).
    lens = torch.cat([seq_lens, seq_lens.new_zeros(1)])  # the last for tokens past every sequence
    return torch.where((lens[layout.token_seq.long()] > 0)[:, None], kept, -1)


@triton.jit
def _block_scores_kernel(
    out,
    q,
    k_cache,
    paged,
    block_size,
    local_blocks,
    q_strides,
    k_strides,
    o_strides,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token, seq, pos, bound, table = tiles.token_state(paged, True)
    block = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    at, mask = tiles.token_rows(q, q_strides, token, heads, heads < HEADS, dims, DIM)
    query = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    first = block * block_size
    end = tl.minimum(first + block_size, bound)
    for start in range(first, end, BLOCK_K):
        key_pos = start + tl.arange(0, BLOCK_K)
        key_ok = key_pos < end
        keys = tiles.paged_rows(k_cache, k_strides, paged, table, key_pos, key_ok, 0, dims, DIM)
        scores = tl.dot(query, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        best = tl.maximum(best, tl.max(tl.where(key_ok[None, :], scores, float("-inf")), 1))
    own = pos // block_size  # the query's block and the local_blocks - 1 before it always win
    local = (bound > 0) & (block <= own) & (block > own - local_blocks)
    best = tl.where(local, float("inf"), best)
    tl.store(out + token * o_strides[0] + heads * o_strides[1] + block, best, mask=heads < HEADS)


def block_select(
    idx_q, idx_k_cache, block_tables, seq_lens, query_start_loc, positions, block_size, topk_blocks, local_blocks
) -> Tensor:
    """flare::block_select (helios.core.ops.block_sparse): each indexer head's blocks, best first."""
    num_tokens, heads, dim = idx_q.shape
    blocks = triton.cdiv(block_tables.shape[1] * idx_k_cache.shape[1], block_size)
    scores = torch.full((num_tokens, heads, blocks), float("-inf"), dtype=torch.float32, device=idx_q.device)
    if num_tokens and blocks and block_tables.shape[0]:
        idx_q = idx_q.contiguous()
        layout = tiles.layout_of(block_tables, seq_lens, query_start_loc, positions, idx_k_cache.shape[1])
        strides = (idx_q.stride()[:2], idx_k_cache.stride()[:2], scores.stride()[:2])
        sizes = {"HEADS": heads, "DIM": dim, "BLOCK_H": tiles.pow2(heads), "BLOCK_D": tiles.pow2(dim)}
        sizes["BLOCK_K"] = min(tiles.KV_TILE, tiles.pow2(block_size))
        tensors = (scores, idx_q, idx_k_cache, layout)
        _block_scores_kernel[(num_tokens, blocks)](*tensors, block_size, local_blocks, *strides, **sizes)
    return _best_first(scores, topk_blocks)


@triton.jit
def _listed_attention_kernel(
    out,
    q,
    k_cache,
    v_cache,
    listed,
    paged,
    scale,
    block_size,
    num_listed,
    q_strides,
    k_strides,
    v_strides,
    l_strides,
    o_strides,
    RUN: tl.constexpr,
    PER_SELECTION: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Flash attention of one query token's run of heads over the keys `listed` names: key blocks
    (BLOCKS: block_sparse_attention) or key positions (sparse_paged_attention)."""
    token, seq, pos, bound, table = tiles.token_state(paged, True)
    first_head = tl.program_id(1) * RUN
    k_base = (first_head // GROUP) * k_strides[2]
    v_base = (first_head // GROUP) * v_strides[2]
    rows = tl.arange(0, BLOCK_M)
    head = first_head + rows
    row_ok = rows < RUN
    dims = tl.arange(0, BLOCK_D)
    at, mask = tiles.token_rows(q, q_strides, token, head, row_ok, dims, DIM)
    query = tl.load(at, mask=mask, other=0.0)
    chosen = listed + token * l_strides[0] + (first_head // PER_SELECTION) * l_strides[1]
    m_i, l_i, acc = tiles.softmax_start(q, head, row_ok, BLOCK_M, BLOCK_D, False)
    if BLOCKS:
        picks = tl.arange(0, BLOCK_P)
        ids = tl.load(chosen + picks, mask=picks < num_listed, other=-1)
        for pick in range(0, num_listed):
            block = tl.load(chosen + pick)
            earlier = tl.sum(((ids == block) & (picks < pick)).to(tl.int32))  # listed before: counted once
            first = block * block_size
            end = tl.where((block >= 0) & (earlier == 0), tl.minimum(first + block_size, bound), first)
            for start in range(first, end, BLOCK_N):
                key_pos = start + tl.arange(0, BLOCK_N)
                key_ok = key_pos < end
                keys = tiles.paged_rows(k_cache, k_strides, paged, table, key_pos, key_ok, k_base, dims, DIM)
                values = tiles.paged_rows(v_cache, v_strides, paged, table, key_pos, key_ok, v_base, dims, DIM)
                scores = tiles.tile_scores(query, keys, key_ok[None, :] & row_ok[:, None], scale, 0.0, False)
                m_i, l_i, acc = tiles.softmax_step(scores, values.to(query.dtype), m_i, l_i, acc)
    else:  # the positions, sorted with repeats as -1 (sparse_paged_attention)
        for start in range(0, num_listed, BLOCK_N):
            at_list = start + tl.arange(0, BLOCK_N)
            key_pos = tl.load(chosen + at_list, mask=at_list < num_listed, other=-1)
            key_ok = (key_pos >= 0) & (key_pos < bound)
            keys = tiles.paged_rows(k_cache, k_strides, paged, table, key_pos, key_ok, k_base, dims, DIM)
            values = tiles.paged_rows(v_cache, v_strides, paged, table, key_pos, key_ok, v_base, dims, DIM)
            scores = tiles.tile_scores(query, keys, key_ok[None, :] & row_ok[:, None], scale, 0.0, False)
            m_i, l_i, acc = tiles.softmax_step(scores, values.to(query.dtype), m_i, l_i, acc)
    tiles.store_result(out, o_strides, token, head, row_ok, acc, l_i, dims, DIM)


def _listed_attention(q, k_cache, v_cache, listed, layout: tiles.Paged, scale, block_size: int, run: int) -> Tensor:
    """Launch `_listed_attention_kernel`: listed [T, selection heads, blocks] block ids (block_size > 0)
    or [T, 1, n] key positions (block_size 0); programs of `run` heads sharing a kv head and a
    selection head."""
    num_tokens, num_heads, dim = q.shape
    out = torch.zeros_like(q)
    if num_tokens == 0 or layout.num_seqs == 0 or listed.shape[2] == 0:
        return out
    q, listed = q.contiguous(), listed.contiguous()
    strides = (q.stride()[:2], k_cache.stride()[:3], v_cache.stride()[:3], listed.stride()[:2], out.stride()[:2])
    heads = {"RUN": run, "PER_SELECTION": num_heads // listed.shape[1], "GROUP": num_heads // k_cache.shape[2]}
    if block_size:  # BLOCK_N within a block; BLOCK_P covers the picks (the de-duplication reads them all)
        tile, picks = min(tiles.KV_TILE, tiles.pow2(block_size)), triton.next_power_of_2(listed.shape[2])
    else:
        tile, picks = tiles.KV_TILE, 1
    blocks = {"BLOCK_M": tiles.pow2(run), "BLOCK_D": tiles.pow2(dim), "BLOCK_N": tile, "BLOCK_P": picks}
    blocks["BLOCKS"] = block_size > 0
    warps = tiles.warps(tiles.pow2(run), tiles.pow2(dim))
    tensors = (out, q, k_cache, v_cache, listed, layout)
    _listed_attention_kernel[(num_tokens, num_heads // run)](
        *tensors, float(scale), block_size, listed.shape[2], *strides, **heads, DIM=dim, **blocks, num_warps=warps
    )
    return out


def block_sparse_attention(
    q, k_cache, v_cache, block_ids, block_tables, seq_lens, query_start_loc, positions, scale, block_size
) -> Tensor:
    """flare::block_sparse_attention (helios.core.ops.block_sparse): attention over the selected blocks."""
    layout = tiles.layout_of(block_tables, seq_lens, query_start_loc, positions, k_cache.shape[1])
    per_selection, group = q.shape[1] // block_ids.shape[1], q.shape[1] // k_cache.shape[2]
    run = math.gcd(per_selection, group)  # consecutive heads sharing a selection head and a kv head
    return _listed_attention(q, k_cache, v_cache, block_ids, layout, scale, block_size, run)


def sparse_paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, topk_indices, scale
) -> Tensor:
    """flare::sparse_paged_attention (helios.core.ops.sparse): attention over each query's listed keys."""
    # Ascending, each key once (a key listed twice counts once): repeats become -1.
    listed = topk_indices.sort(dim=1).values
    repeat = torch.nn.functional.pad(listed[:, 1:] == listed[:, :-1], (1, 0), value=False)
    listed = torch.where(repeat, -1, listed)[:, None, :]
    layout = tiles.layout_of(block_tables, seq_lens, query_start_loc, positions, k_cache.shape[1])
    group = q.shape[1] // k_cache.shape[2]  # a program: one kv head's query heads
    return _listed_attention(q, k_cache, v_cache, listed, layout, scale, 0, group)


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
