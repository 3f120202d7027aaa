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

from helios.engine.cuda import tiles

HEAD_TILE = 16  # query heads per program of _dsv4_attention_kernel


@triton.jit
def _dsv4_pool_kernel(
    out,
    state,
    paged,
    rate,
    s_strides,
    o_tok,
    WIDTH: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    token, seq, pos, bound, table = tiles.token_state(paged, False)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if (bound < rate) | ((pos + 1) % rate != 0):
        return  # completes no group: stays zero
    slots = tl.arange(0, BLOCK_R)
    first = pos + 1 - rate
    own_pos = first + slots
    own_ok = slots < rate
    half = DIM if OVERLAP else 0  # with overlap a group's own slots use the second halves
    kv = tiles.paged_rows(state, s_strides, paged, table, own_pos, own_ok, half, channels, DIM).to(tl.float32)
    gate = tiles.paged_rows(state, s_strides, paged, table, own_pos, own_ok, WIDTH + half, channels, DIM)
    gate = tl.where(own_ok[:, None], gate.to(tl.float32), float("-inf"))
    top = tl.max(gate, 0)
    if OVERLAP:  # and the previous group's slots, through the first halves
        prev_pos = first - rate + slots
        prev_ok = own_ok & (prev_pos >= 0)  # group 0 has none
        kv_prev = tiles.paged_rows(state, s_strides, paged, table, prev_pos, prev_ok, 0, channels, DIM)
        gate_prev = tiles.paged_rows(state, s_strides, paged, table, prev_pos, prev_ok, WIDTH, channels, DIM)
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
    block_d = min(64, tiles.pow2(dim))
    layout = tiles.layout_of(block_tables, None, query_start_loc, positions, state_cache.shape[1])
    sizes = {"WIDTH": width, "DIM": dim, "BLOCK_R": triton.next_power_of_2(rate), "BLOCK_D": block_d}
    _dsv4_pool_kernel[(num_tokens, triton.cdiv(dim, block_d))](
        out, state_cache, layout, rate, state_cache.stride()[:2], out.stride(0), **sizes, OVERLAP=overlap
    )
    return out


@triton.jit
def _dsv4_attention_kernel(
    out,
    q,
    kv_cache,
    entry_cache,
    paged,
    sinks,
    selected,
    scale,
    window,
    rate,
    num_selected,
    q_strides,
    kv_strides,
    e_strides,
    o_strides,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    HAS_SELECTED: tl.constexpr,
):
    token, seq, pos, bound, table = tiles.token_state(paged, False)
    rows = tl.arange(0, BLOCK_H)
    head = tl.program_id(1) * BLOCK_H + rows
    row_ok = head < HEADS
    dims = tl.arange(0, BLOCK_D)
    at, mask = tiles.token_rows(q, q_strides, token, head, row_ok, dims, DIM)
    query = tl.load(at, mask=mask, other=0.0)
    m_i, l_i, acc = tiles.softmax_start(sinks, head, row_ok, BLOCK_H, BLOCK_D, True)
    # The raw rows (keys and values alike) in the window.
    for start in range(tl.maximum(bound - window, 0), bound, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < bound
        rows_kv = tiles.paged_rows(kv_cache, kv_strides, paged, table, key_pos, key_ok, 0, dims, DIM)
        rows_kv = rows_kv.to(query.dtype)
        scores = tiles.tile_scores(query, rows_kv, key_ok[None, :] & row_ok[:, None], scale, 0.0, False)
        m_i, l_i, acc = tiles.softmax_step(scores, rows_kv, m_i, l_i, acc)
    if HAS_ENTRIES:  # then the compressed entries: the selected ones, or every complete one
        if HAS_SELECTED:
            count = tl.where(bound > 0, num_selected, 0)
        else:
            count = bound // rate
        for start in range(0, count, BLOCK_N):
            listed = start + tl.arange(0, BLOCK_N)
            if HAS_SELECTED:
                entry = tl.load(selected + token * num_selected + listed, mask=listed < count, other=-1)
            else:
                entry = tl.where(listed < count, listed, -1)
            key_ok = entry >= 0
            rows_e = tiles.paged_rows(
                entry_cache, e_strides, paged, table, (entry + 1) * rate - 1, key_ok, 0, dims, DIM
            )
            rows_e = rows_e.to(query.dtype)
            scores = tiles.tile_scores(query, rows_e, key_ok[None, :] & row_ok[:, None], scale, 0.0, False)
            m_i, l_i, acc = tiles.softmax_step(scores, rows_e, m_i, l_i, acc)
    tiles.store_result(out, o_strides, token, head, row_ok, acc, l_i, dims, DIM)


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
    # contiguous: the kernel takes rows num_selected apart
    chosen = selected.contiguous() if entries and selected is not None else None
    cache = entry_cache if entries else kv_cache
    layout = tiles.layout_of(block_tables, None, query_start_loc, positions, kv_cache.shape[1])
    tensors = (out, q, kv_cache, cache, layout, sinks.contiguous(), positions if chosen is None else chosen)
    counts = (float(scale), window, max(rate, 1), 0 if chosen is None else chosen.shape[1])
    strides = (q.stride()[:2], kv_cache.stride()[:2], cache.stride()[:2], out.stride()[:2])
    sizes = {"HEADS": heads, "DIM": dim, "BLOCK_H": HEAD_TILE, "BLOCK_D": tiles.pow2(dim), "BLOCK_N": tiles.KV_TILE}
    flags = {
        "HAS_ENTRIES": entries,
        "HAS_SELECTED": chosen is not None,
        "num_warps": tiles.warps(HEAD_TILE, tiles.pow2(dim)),
    }
    _dsv4_attention_kernel[(num_tokens, triton.cdiv(heads, HEAD_TILE))](*tensors, *counts, *strides, **sizes, **flags)
    return out
