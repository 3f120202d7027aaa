"""What helios' Triton kernels share: reading paged rows, the online softmax, a token's sequence.

All @triton.jit helpers, inlined into the kernels that call them (helios.engine.cuda.attention,
.sparse, .deepseek_v4), plus the block-size rules every launch follows.
"""

from __future__ import annotations

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


def sequences(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    """[T] int32: each token's sequence (num_seqs for a token past the last one), computed on the device."""
    return token_sequences(query_start_loc, num_tokens).to(torch.int32)


@triton.jit
def paged_rows(cache, table, key_pos, key_ok, page_tokens, c_page, c_tok, base, cols, WIDTH):
    """[N, C] cache entries [page, offset, base + cols] (cols < WIDTH) of the positions key_pos
    [N] of one sequence (block table `table`), where key_ok; zeros elsewhere."""
    page = tl.load(table + key_pos // page_tokens, mask=key_ok, other=0).to(tl.int64)
    rows = page * c_page + (key_pos % page_tokens) * c_tok + base
    return tl.load(cache + rows[:, None] + cols[None, :], mask=key_ok[:, None] & (cols < WIDTH)[None, :], other=0.0)


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
def softmax_result(acc, l_i):
    """The attention output from the online softmax's state: zeros for a row that saw nothing."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def token_state(token_seq, positions, seq_lens, token, num_seqs, HAS_LENS: tl.constexpr):
    """(seq, position, visible keys bound): keys j < bound may be seen (0 for a token of no
    sequence, or of a sequence without history); bound = pos + 1 capped by the sequence length."""
    seq = tl.load(token_seq + token)
    live = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    pos = tl.load(positions + token)
    bound = tl.maximum(pos + 1, 0)
    if HAS_LENS:
        bound = tl.minimum(bound, tl.load(seq_lens + seq))
    return seq, pos, tl.where(live, bound, 0)
