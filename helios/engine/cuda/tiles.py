"""What helios' Triton kernels share: a step's paged layout, reading paged rows, the online softmax.

All @triton.jit helpers, inlined into the kernels that call them (helios.engine.cuda.attention,
.sparse, .deepseek_v4), plus the block-size rules every launch follows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from helios.core.ops.deepseek_v4 import token_sequences

KV_TILE = 32  # keys per inner step of the attention kernels (their BLOCK_N)
MIN_DOT = 16  # the smallest tl.dot dimension a GPU accepts


def pow2(n: int, floor: int = MIN_DOT) -> int:
    """The next power of two >= n, at least `floor` (a block size covering n)."""
    return max(floor, triton.next_power_of_2(n))


def warps(rows: int, width: int) -> int:
    """Warps for a kernel whose fp32 accumulator is [rows, width]: 8 from 16 x 128 on (fewer spill
    registers on sm_90: tests.cuda.sm90_launches reports them), else 4."""
    return 8 if rows * width >= 16 * 128 else 4


class Paged(NamedTuple):
    """A step's paged layout as the kernels read it, passed as ONE kernel argument (Triton takes a
    NamedTuple whole, a frozen dataclass not): every paged kernel reads the same few tensors."""

    block_tables: Tensor  # [num_seqs, max_blocks] int32
    bt_row: int  # block_tables.stride(0)
    seq_lens: Tensor  # [num_seqs]; read only by kernels told HAS_LENS (ops without lengths pass positions)
    query_start_loc: Tensor  # [num_seqs + 1]
    token_seq: Tensor  # [T] int32 each token's sequence (num_seqs past the last), or unread (see layout_of())
    positions: Tensor  # [T]
    num_seqs: int
    page_tokens: int


def layout_of(
    block_tables: Tensor,
    seq_lens: Tensor | None,
    query_start_loc: Tensor,
    positions: Tensor,
    page_tokens: int,
    per_token: bool = True,
) -> Paged:
    """The Paged layout of an op's arguments. per_token: kernels that take one query token per
    program read each token's sequence (a device-side searchsorted, computed here); the dense
    attention kernel finds its sequence from query_start_loc instead and skips that launch."""
    num_tokens = positions.shape[0]
    token_seq = token_sequences(query_start_loc, num_tokens).to(torch.int32) if per_token else query_start_loc
    lens = positions if seq_lens is None else seq_lens
    num_seqs = block_tables.shape[0]
    return Paged(
        block_tables, block_tables.stride(0), lens, query_start_loc, token_seq, positions, num_seqs, page_tokens
    )


@triton.jit
def paged_rows(cache, strides, paged, table, key_pos, key_ok, base, cols, WIDTH):
    """[N, C] cache entries [page, offset, base + cols] (cols < WIDTH) of the positions key_pos [N]
    of one sequence (block table row `table`), where key_ok; zeros elsewhere. strides: the cache's
    (page, token, ...) strides."""
    page = tl.load(table + key_pos // paged.page_tokens, mask=key_ok, other=0).to(tl.int64)
    rows = page * strides[0] + (key_pos % paged.page_tokens) * strides[1] + base
    return tl.load(cache + rows[:, None] + cols[None, :], mask=key_ok[:, None] & (cols < WIDTH)[None, :], other=0.0)


@triton.jit
def token_rows(ptr, strides, token, head, row_ok, cols, WIDTH):
    """[M, C] pointers and mask of the rows (token, head) (token one, or one per row) of a
    [T, H, D] tensor with (token, head) strides: where a kernel reads its queries, writes its output."""
    at = ptr + (token * strides[0] + head * strides[1])[:, None] + cols[None, :]
    return at, row_ok[:, None] & (cols < WIDTH)[None, :]


@triton.jit
def token_state(paged, HAS_LENS: tl.constexpr):
    """(token, seq, position, visible keys bound, block table row) of the query token of a kernel
    that takes one per program (along grid axis 0): keys j < bound may be seen (0 for a token of no
    sequence, or of a sequence without history); bound = pos + 1 capped by the sequence length."""
    token = tl.program_id(0)
    seq = tl.load(paged.token_seq + token)
    live = seq < paged.num_seqs
    seq = tl.minimum(seq, paged.num_seqs - 1)
    pos = tl.load(paged.positions + token)
    bound = tl.maximum(pos + 1, 0)
    if HAS_LENS:
        bound = tl.minimum(bound, tl.load(paged.seq_lens + seq))
    return token, seq, pos, tl.where(live, bound, 0), paged.block_tables + seq.to(tl.int64) * paged.bt_row


@triton.jit
def softmax_start(sinks, head, row_ok, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's state (running max, running sum, output) before any key: empty, or
    holding each row's sink logit sinks[head] as a key of value zero (max = sink, sum = 1)."""
    if HAS_SINKS:
        m_i = tl.load(sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i, tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)


@triton.jit
def tile_scores(query, keys, visible, scale, softcap, SOFTCAP: tl.constexpr):
    """[M, N] fp32 scores query . keys * scale of one tile of keys (soft-capped when SOFTCAP), -inf
    where not `visible`; the dot products in the queries' dtype (fp32 at IEEE precision, or 16-bit
    with fp32 accumulation), as the references cast the cache to it."""
    scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision="ieee") * scale
    if SOFTCAP:
        capped = scores / softcap
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0))  # tanh, overflow-safe
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def softmax_step(scores, values, m_i, l_i, acc):
    """One tile of keys into the online softmax: scores [M, N] fp32 (-inf where a key is not
    visible), values [N, DV] in the dtype of the P @ V product (fp32 at IEEE precision, or 16-bit)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    weights = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(weights, 1)
    acc = acc * alpha[:, None] + tl.dot(weights.to(values.dtype), values, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def store_result(out, strides, token, head, row_ok, acc, l_i, cols, WIDTH):
    """Write the attention output of the online softmax's state to out's rows (token, head): zeros
    for a row that saw nothing."""
    at, mask = token_rows(out, strides, token, head, row_ok, cols, WIDTH)
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(at, result.to(out.dtype.element_ty), mask=mask)
