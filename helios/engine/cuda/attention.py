"""Triton kernels for the paged-attention flare:: ops: write_kv, paged_attention(_until), sink_attention.

* `_write_kv_kernel` stores one token's keys and values (every kv head) into its cache slot;
  a negative slot (padding) writes nothing. Grid: (num_tokens,).
* `_attention_kernel` is one flash-attention kernel for decode rows and prefill/verification
  chunks alike, over the paged pool. A program takes BLOCK_Q consecutive query tokens of ONE
  sequence and the GROUP query heads that share one kv head (GQA), as BLOCK_M = BLOCK_Q * G_PAD
  rows, and walks that sequence's keys in tiles of BLOCK_N positions, reading each key's page
  through the block table, with an online (fp32) softmax. Grid: (num_tokens // BLOCK_Q +
  num_seqs, num_kv_heads): an upper bound on the query blocks of any split of the tokens into
  sequences (vLLM's unified-attention layout), so the grid depends on shapes only; each program
  finds its sequence by a binary search over query_start_loc and exits when it has no rows.
  The key range is bounded per program from its rows' positions (window and causal edge), so a
  sliding layer reads only the window. The one kernel serves:
  - flare::paged_attention: key j visible iff pos - window < j <= pos (window 0: j <= pos),
    optional logit soft-capping;
  - flare::paged_attention_until: the causal edge is until[t] instead of pos;
  - flare::sink_attention: keys and values packed in one cache row (Dk then Dv, Dv may differ),
    and an optional sink logit per query head, which starts the online softmax as a key of
    value zero (m = sink, l = 1).

Nothing reads a tensor's value on the host: sequence lengths, positions and block tables are
loaded in the kernels, so every call is capturable in a CUDA graph. Scores, softmax and
accumulation are fp32; the dot products take the queries' dtype (fp32 at IEEE precision, or
16-bit with fp32 accumulation), as the references cast the cache to the queries' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from helios.engine.cuda import tiles

DECODE_ROWS = 16  # BLOCK_M (query tokens x grouped heads) when every sequence has one query
PREFILL_ROWS = 64  # BLOCK_M otherwise


@triton.jit
def _write_kv_kernel(
    k_cache,
    v_cache,
    k,
    v,
    slot_mapping,
    page_tokens,
    kc_page,
    kc_tok,
    kc_head,
    vc_page,
    vc_tok,
    vc_head,
    k_tok,
    k_head,
    v_tok,
    v_head,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return  # a padding row
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    keep = (heads < HEADS) & (dims < DIM)
    page = slot // page_tokens
    offset = slot % page_tokens
    key = tl.load(k + token * k_tok + heads * k_head + dims, mask=keep)
    value = tl.load(v + token * v_tok + heads * v_head + dims, mask=keep)
    k_at = k_cache + page * kc_page + offset * kc_tok + heads * kc_head + dims
    v_at = v_cache + page * vc_page + offset * vc_tok + heads * vc_head + dims
    tl.store(k_at, key.to(k_cache.dtype.element_ty), mask=keep)
    tl.store(v_at, value.to(v_cache.dtype.element_ty), mask=keep)


@triton.jit
def find_sequence(query_start_loc, num_seqs, block, BLOCK_Q: tl.constexpr):
    """The sequence of query block `block`: the last i with query_start_loc[i] // BLOCK_Q + i <= block."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attention_kernel(
    out,
    q,
    k_cache,
    v_cache,
    paged,
    until,
    sinks,
    scale,
    softcap,
    window,
    q_strides,
    k_strides,
    v_strides,
    o_strides,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_UNTIL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_sequence(paged.query_start_loc, paged.num_seqs, block, BLOCK_Q)
    q_start = tl.load(paged.query_start_loc + seq)
    q_end = tl.load(paged.query_start_loc + seq + 1)
    first = q_start + (block - q_start // BLOCK_Q - seq) * BLOCK_Q
    kv_len = tl.load(paged.seq_lens + seq)
    if (first >= q_end) | (kv_len <= 0):
        return  # no rows here (the output stays zero for a sequence without history)

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // G_PAD
    head = kv_head * GROUP + rows % G_PAD
    row_ok = (token < q_end) & (rows % G_PAD < GROUP)
    pos = tl.load(paged.positions + token, mask=row_ok, other=0)
    if HAS_UNTIL:
        edge = tl.load(until + token, mask=row_ok, other=0)
    else:
        edge = pos
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    at, mask = tiles.token_rows(q, q_strides, token, head, row_ok, dk, DK)
    query = tl.load(at, mask=mask, other=0.0)

    # The keys any row here may see: [lo, hi).
    hi = tl.minimum(tl.max(tl.where(row_ok, edge, -1)) + 1, kv_len)
    lo = tl.maximum(tl.min(tl.where(row_ok, pos, kv_len)) - window + 1, 0)
    lo = tl.where(window > 0, lo, 0)

    m_i, l_i, acc = tiles.softmax_start(sinks, head, row_ok, BLOCK_M, BLOCK_DV, HAS_SINKS)
    table = paged.block_tables + seq.to(tl.int64) * paged.bt_row
    k_base, v_base = kv_head * k_strides[2], kv_head * v_strides[2]
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < hi
        keys = tiles.paged_rows(k_cache, k_strides, paged, table, key_pos, key_ok, k_base, dk, DK)
        visible = key_ok[None, :] & (key_pos[None, :] <= edge[:, None]) & row_ok[:, None]
        visible = visible & ((window <= 0) | (key_pos[None, :] > pos[:, None] - window))
        scores = tiles.tile_scores(query, keys, visible, scale, softcap, SOFTCAP)
        values = tiles.paged_rows(v_cache, v_strides, paged, table, key_pos, key_ok, v_base, dv, DV)
        m_i, l_i, acc = tiles.softmax_step(scores, values.to(query.dtype), m_i, l_i, acc)
    tiles.store_result(out, o_strides, token, head, row_ok, acc, l_i, dv, DV)


def _attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    layout: tiles.Paged,
    scale: float,
    window: int,
    softcap: float,
    until: Tensor | None,
    sinks: Tensor | None,
) -> Tensor:
    """Launch `_attention_kernel`: k_cache/v_cache may be views of one packed cache (Dv = v's width)."""
    num_tokens, num_heads, dk = q.shape
    kv_heads, dv = k_cache.shape[2], v_cache.shape[3]
    group = num_heads // kv_heads
    out = q.new_zeros(num_tokens, num_heads, dv)
    if num_tokens == 0 or layout.num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    g_pad = triton.next_power_of_2(group)
    rows = DECODE_ROWS if num_tokens <= layout.num_seqs else PREFILL_ROWS
    block_q = max(1, rows // g_pad)
    strides = (q.stride()[:2], k_cache.stride()[:3], v_cache.stride()[:3], out.stride()[:2])
    extras = (layout.positions if until is None else until, q if sinks is None else sinks)
    blocks = {"GROUP": group, "G_PAD": g_pad, "BLOCK_Q": block_q, "BLOCK_N": tiles.KV_TILE}
    widths = {"DK": dk, "DV": dv, "BLOCK_DK": tiles.pow2(dk), "BLOCK_DV": tiles.pow2(dv)}
    flags = {"HAS_UNTIL": until is not None, "HAS_SINKS": sinks is not None, "SOFTCAP": softcap > 0.0}
    _attention_kernel[(num_tokens // block_q + layout.num_seqs, kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        layout,
        *extras,
        float(scale),
        float(softcap),
        int(window),
        *strides,
        **blocks,
        **widths,
        **flags,
        num_warps=tiles.warps(block_q * g_pad, tiles.pow2(max(dk, dv))),
    )
    return out


def write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """flare::write_kv: store each token's keys/values at its slot (negative slots write nothing)."""
    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k_cache,
        v_cache,
        k,
        v,
        slot_mapping,
        k_cache.shape[1],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
    )


def _layout(block_tables, seq_lens, query_start_loc, positions, cache) -> tiles.Paged:
    """The dense kernel's Paged layout: it finds each block's sequence from query_start_loc itself."""
    return tiles.layout_of(block_tables, seq_lens, query_start_loc, positions, cache.shape[1], per_token=False)


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0
) -> Tensor:
    """flare::paged_attention (helios.core.ops.base) for decode rows and prefill chunks alike."""
    layout = _layout(block_tables, seq_lens, query_start_loc, positions, k_cache)
    return _attend(q, k_cache, v_cache, layout, scale, window, softcap, None, None)


def paged_attention_until(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, until, scale, window=0, softcap=0.0
) -> Tensor:
    """flare::paged_attention_until (helios.core.ops.bidirectional): the causal edge is until[t]."""
    layout = _layout(block_tables, seq_lens, query_start_loc, positions, k_cache)
    return _attend(q, k_cache, v_cache, layout, scale, window, softcap, until, None)


def sink_attention(
    q, kv_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, sinks=None
) -> Tensor:
    """flare::sink_attention (helios.core.ops.sinks): packed key|value rows, optional sink logits."""
    dk = q.shape[-1]
    layout = _layout(block_tables, seq_lens, query_start_loc, positions, kv_cache)
    return _attend(q, kv_cache[..., :dk], kv_cache[..., dk:], layout, scale, window, 0.0, None, sinks)


def register(library: torch.library.Library) -> None:
    """Install these kernels in the flare:: ops' CUDA slot."""
    for name, fn in (
        ("write_kv", write_kv),
        ("paged_attention", paged_attention),
        ("paged_attention_until", paged_attention_until),
        ("sink_attention", sink_attention),
    ):
        library.impl(name, fn, "CUDA")
