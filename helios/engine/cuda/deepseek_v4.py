"""Triton kernels for DeepSeek-V4's compressed-attention ops (helios.core.ops.deepseek_v4).

* `_dsv4_pool_kernel` (flare::dsv4_pool): the per-channel softmax-gated pool of the group a token
  completes (two groups' halves with `overlap`); zeros for other tokens. Grid: (num_tokens,
  cdiv(D, BLOCK_D)).
* `_dsv4_attention_kernel` (flare::dsv4_attention): sink attention (K = V) over the raw rows in the
  window, then the compressed entries (every complete one, or the selected ones), with an online
  softmax that starts from the sink. Grid: (num_tokens, cdiv(num_heads, HEAD_TILE)).

flare::dsv4_indexer_topk shares the indexer scoring kernel of helios.engine.cuda.sparse, which
registers all three. Capturable: tokens' sequences and positions are read in the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

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

HEAD_TILE = 16  # query heads per program of _dsv4_attention_kernel


@triton.jit
def _dsv4_pool_kernel(
    out,
    state,
    block_tables,
    token_seq,
    positions,
    rate,
    page_tokens,
    num_seqs,
    s_page,
    s_tok,
    bt_row,
    o_tok,
    WIDTH: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    token = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    seq, pos, bound = token_state(token_seq, positions, positions, token, num_seqs, False)
    if (bound < rate) | ((pos + 1) % rate != 0):
        return  # completes no group: stays zero
    table = block_tables + seq.to(tl.int64) * bt_row
    slots = tl.arange(0, BLOCK_R)
    first = pos + 1 - rate
    own_pos = first + slots
    own_ok = slots < rate
    half = DIM if OVERLAP else 0  # with overlap a group's own slots use the second halves
    kv = paged_rows(state, table, own_pos, own_ok, page_tokens, s_page, s_tok, half, channels, DIM).to(tl.float32)
    gate = paged_rows(state, table, own_pos, own_ok, page_tokens, s_page, s_tok, WIDTH + half, channels, DIM)
    gate = tl.where(own_ok[:, None], gate.to(tl.float32), float("-inf"))
    top = tl.max(gate, 0)
    if OVERLAP:  # and the previous group's slots, through the first halves
        prev_pos = first - rate + slots
        prev_ok = own_ok & (prev_pos >= 0)  # group 0 has none
        kv_prev = paged_rows(state, table, prev_pos, prev_ok, page_tokens, s_page, s_tok, 0, channels, DIM)
        gate_prev = paged_rows(state, table, prev_pos, prev_ok, page_tokens, s_page, s_tok, WIDTH, channels, DIM)
        gate_prev = tl.where(prev_ok[:, None], gate_prev.to(tl.float32), float("-inf"))
        top = tl.maximum(top, tl.max(gate_prev, 0))
        weight_prev = tl.exp(gate_prev - top[None, :])
        weight = tl.exp(gate - top[None, :])
        total = tl.sum(weight * kv, 0) + tl.sum(weight_prev * kv_prev.to(tl.float32), 0)
        pooled = total / (tl.sum(weight, 0) + tl.sum(weight_prev, 0))
    else:
        weight = tl.exp(gate - top[None, :])
        pooled = tl.sum(weight * kv, 0) / tl.sum(weight, 0)
    tl.store(out + token * o_tok + channels, pooled, mask=channels < DIM)


def dsv4_pool(state_cache, block_tables, query_start_loc, positions, rate, overlap) -> Tensor:
    """flare::dsv4_pool (helios.core.ops.deepseek_v4): the pool of every group a token completes."""
    width = state_cache.shape[-1] // 2
    dim = width // 2 if overlap else width
    num_tokens = positions.shape[0]
    out = torch.zeros(num_tokens, dim, dtype=torch.float32, device=positions.device)
    if num_tokens == 0 or block_tables.shape[0] == 0:
        return out
    block_d = min(64, pow2(dim))
    _dsv4_pool_kernel[(num_tokens, triton.cdiv(dim, block_d))](
        out,
        state_cache,
        block_tables,
        sequences(query_start_loc, num_tokens),
        positions,
        rate,
        state_cache.shape[1],
        block_tables.shape[0],
        state_cache.stride(0),
        state_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        WIDTH=width,
        DIM=dim,
        BLOCK_R=triton.next_power_of_2(rate),
        BLOCK_D=block_d,
        OVERLAP=overlap,
    )
    return out


@triton.jit
def _dsv4_attention_kernel(
    out,
    q,
    kv_cache,
    entry_cache,
    block_tables,
    token_seq,
    positions,
    sinks,
    selected,
    scale,
    window,
    rate,
    page_tokens,
    num_seqs,
    num_selected,
    q_tok,
    q_head,
    kv_page,
    kv_tok,
    e_page,
    e_tok,
    s_tok,
    bt_row,
    o_tok,
    o_head,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    HAS_SELECTED: tl.constexpr,
):
    token = tl.program_id(0)
    rows = tl.arange(0, BLOCK_H)
    head = tl.program_id(1) * BLOCK_H + rows
    row_ok = head < HEADS
    seq, pos, bound = token_state(token_seq, positions, positions, token, num_seqs, False)
    table = block_tables + seq.to(tl.int64) * bt_row
    dims = tl.arange(0, BLOCK_D)
    query = tl.load(q + token * q_tok + head[:, None] * q_head + dims[None, :], mask=row_ok[:, None] & (dims < DIM))
    m_i, l_i, acc = softmax_start(sinks, head, row_ok, BLOCK_H, BLOCK_D, True)
    # The raw rows (keys and values alike) in the window.
    for start in range(tl.maximum(bound - window, 0), bound, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < bound
        rows_kv = paged_rows(kv_cache, table, key_pos, key_ok, page_tokens, kv_page, kv_tok, 0, dims, DIM)
        rows_kv = rows_kv.to(query.dtype)
        scores = tl.dot(query, tl.trans(rows_kv), input_precision="ieee") * scale
        scores = tl.where(key_ok[None, :] & row_ok[:, None], scores, float("-inf"))
        m_i, l_i, acc = softmax_step(scores, rows_kv, m_i, l_i, acc)
    if HAS_ENTRIES:  # then the compressed entries: the selected ones, or every complete one
        if HAS_SELECTED:
            count = tl.where(bound > 0, num_selected, 0)
        else:
            count = bound // rate
        for start in range(0, count, BLOCK_N):
            listed = start + tl.arange(0, BLOCK_N)
            if HAS_SELECTED:
                entry = tl.load(selected + token * s_tok + listed, mask=listed < count, other=-1)
            else:
                entry = tl.where(listed < count, listed, -1)
            key_ok = entry >= 0
            key_pos = (entry + 1) * rate - 1
            rows_e = paged_rows(entry_cache, table, key_pos, key_ok, page_tokens, e_page, e_tok, 0, dims, DIM)
            rows_e = rows_e.to(query.dtype)
            scores = tl.dot(query, tl.trans(rows_e), input_precision="ieee") * scale
            scores = tl.where(key_ok[None, :] & row_ok[:, None], scores, float("-inf"))
            m_i, l_i, acc = softmax_step(scores, rows_e, m_i, l_i, acc)
    at = out + token * o_tok + head[:, None] * o_head + dims[None, :]
    tl.store(at, softmax_result(acc, l_i).to(out.dtype.element_ty), mask=row_ok[:, None] & (dims < DIM)[None, :])


def dsv4_attention(
    q, kv_cache, entry_cache, block_tables, query_start_loc, positions, sinks, scale, window, rate, selected
) -> Tensor:
    """flare::dsv4_attention (helios.core.ops.deepseek_v4): sink attention over window rows and entries."""
    num_tokens, heads, dim = q.shape
    out = torch.zeros_like(q)
    if num_tokens == 0 or block_tables.shape[0] == 0:
        return out
    q = q.contiguous()
    entries = entry_cache is not None and rate > 0
    chosen = selected.contiguous() if entries and selected is not None else None
    cache = entry_cache if entries else kv_cache
    _dsv4_attention_kernel[(num_tokens, triton.cdiv(heads, HEAD_TILE))](
        out,
        q,
        kv_cache,
        cache,
        block_tables,
        sequences(query_start_loc, num_tokens),
        positions,
        sinks.contiguous(),
        positions if chosen is None else chosen,
        float(scale),
        window,
        max(rate, 1),
        kv_cache.shape[1],
        block_tables.shape[0],
        0 if chosen is None else chosen.shape[1],
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        cache.stride(0),
        cache.stride(1),
        0 if chosen is None else chosen.stride(0),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=HEAD_TILE,
        BLOCK_D=pow2(dim),
        BLOCK_N=KV_TILE,
        HAS_ENTRIES=entries,
        HAS_SELECTED=chosen is not None,
        num_warps=warps(HEAD_TILE, pow2(dim)),
    )
    return out
