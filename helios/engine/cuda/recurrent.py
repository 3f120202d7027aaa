"""The recurrent-state flare:: ops on CUDA: causal_conv1d, mamba2_scan, gated_delta_rule and kda.

Every kernel follows the state convention of helios.core.ops.recurrent with the sequences'
layout read on the device: a program loads its sequence's rows (query_start_loc), its slot
(state_slots; a negative slot counts from the pool's end, as the reference's Python indexing
does) and whether it starts fresh (its first position is 0: zero state, the slot unread). A
sequence with no rows reads and writes nothing. Grids come from shapes only, so every call is
capturable; all arithmetic is fp32, tl.dot at IEEE fp32 precision.

* causal_conv1d: `_conv_kernel`, grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C)), convolves each row
  from its window (earlier rows of the step, else the slot's saved inputs, else zeros; each row's
  sequence found by a torch.searchsorted over query_start_loc); then `_conv_state_kernel`, grid
  (B, cdiv(C, BLOCK_C)), leaves each slot holding its sequence's last K - 1 window inputs.
* mamba2_scan (`_ssm_kernel`), gated_delta_rule and kda (`_delta_kernel`, the gate's shape tells
  them apart): grid (B, heads, value-channel blocks), a program carrying its block of one head's
  state in registers across its sequence's rows, in one of two forms (a constexpr):
  - recurrent: token by token, the decode form (one row per sequence);
  - chunked: CHUNK rows at a time with matmuls, for prefill chunks: Mamba-2's SSD, and the WY / UT
    form of the delta rule as transformers' torch_chunk_gated_delta_rule and flash-linear-attention
    compute it (the unit-lower-triangular system inverted by forward substitution).
  Both serve any layout (equal up to fp32 rounding); the wrappers take the chunked form when
  the step has more rows than sequences. KDA's per-key-channel decays between two rows of a
  chunk are taken explicitly (no exp(-cumsum) factorization that could overflow), over
  key-channel blocks of KDA_SUB.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from helios.core.ops.gated_delta import L2NORM_EPS
from helios.core.ops.mamba import time_steps

MIN_DOT = 16  # the smallest tl.dot dimension a GPU accepts
SSM_CHUNK = 32  # rows per chunk of the chunked Mamba-2 scan
DELTA_CHUNK = 32  # rows per chunk of the chunked gated delta rule
KDA_CHUNK = 16  # rows per chunk of the chunked KDA (its pairwise decays are [CHUNK, CHUNK, KDA_SUB])
KDA_SUB = 16  # key channels per block of KDA's pairwise decays
VALUE_BLOCK = 32  # value channels (Mamba-2: head channels) per program
CHUNKED_WARPS = 8  # the chunked forms hold several [CHUNK, K] tiles beside the state: more threads, fewer spills


class Form(NamedTuple):
    """Which form a recurrent-state kernel takes: chunked (prefill) or token by token (decode), and
    the rows per chunk (None: the op's default). The wrappers choose by the layout unless given one."""

    chunked: bool
    chunk: int | None = None


def _pow2(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(n))


class Slots(NamedTuple):
    """The sequences' layout and state slots, passed to the kernels as ONE argument (Triton takes a
    NamedTuple whole)."""

    query_start_loc: Tensor  # [B + 1]
    state_slots: Tensor  # [B]
    positions: Tensor  # [T]
    num_slots: int  # the pool's size: a negative slot counts from its end


@triton.jit
def _span(slots):
    """The rows [start, end) of this program's sequence (grid axis 0), its slot, and whether it
    carries state (not fresh)."""
    b = tl.program_id(0)
    start = tl.load(slots.query_start_loc + b).to(tl.int64)  # 64-bit rows: row * stride never overflows
    end = tl.load(slots.query_start_loc + b + 1).to(tl.int64)
    slot = tl.load(slots.state_slots + b).to(tl.int64)
    slot = tl.where(slot < 0, slot + slots.num_slots, slot)
    first = tl.load(slots.positions + start, mask=end > start, other=0)
    return start, end, slot, first != 0


@triton.jit
def _state_tile(state, strides, slot, rows, cols, rows_ok, cols_ok, carried):
    """Pointers, mask and fp32 value (zeros when not carried) of the [R, C] tile (rows, cols) of
    head program_id(1)'s state in `slot`; strides: the pool's (slot, head, row, col) strides."""
    at = state + slot * strides[0] + tl.program_id(1) * strides[1]
    at += rows[:, None] * strides[2] + cols[None, :] * strides[3]
    mask = rows_ok[:, None] & cols_ok[None, :]
    return at, mask, tl.load(at, mask=mask & carried, other=0.0).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


# ---------------------------------------------------------------------------------------------
# causal_conv1d


@triton.jit
def _conv_kernel(
    x,
    weight,
    bias,
    conv_state,
    out,
    token_seq,
    slots,
    num_tokens,
    num_seqs,
    channels,
    stride_x,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    WIDTH: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    seq = tl.load(token_seq + rows, mask=rows < num_tokens, other=num_seqs)
    row_ok = seq < num_seqs  # rows past the last sequence stay zero
    seq = tl.minimum(seq, num_seqs - 1)
    start = tl.load(slots.query_start_loc + seq)
    slot = tl.load(slots.state_slots + seq).to(tl.int64)
    slot = tl.where(slot < 0, slot + slots.num_slots, slot)
    carried = tl.load(slots.positions + start, mask=row_ok, other=0) != 0
    ch_ok = chans < channels
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + tl.load(bias + chans, mask=ch_ok, other=0.0)[None, :]
    for k in tl.static_range(WIDTH):
        src = rows - (WIDTH - 1) + k  # the window input this tap reads
        in_step = src >= start
        mask = (row_ok & in_step)[:, None] & ch_ok[None, :]
        value = tl.load(x + src.to(tl.int64)[:, None] * stride_x + chans[None, :], mask=mask, other=0.0)
        saved = (src - start + WIDTH - 1).to(tl.int64)  # its index in the slot's saved inputs
        mask = (row_ok & ~in_step & carried)[:, None] & ch_ok[None, :]
        history = conv_state + slot[:, None] * stride_ss + chans[None, :] * stride_sc + saved[:, None] * stride_sk
        value = value.to(tl.float32) + tl.load(history, mask=mask, other=0.0).to(tl.float32)
        tap = tl.load(weight + chans * stride_wc + k * stride_wk, mask=ch_ok, other=0.0).to(tl.float32)
        acc += value * tap[None, :]
    if SILU:
        acc = acc * _sigmoid(acc)
    mask = row_ok[:, None] & ch_ok[None, :]
    out_at = out + rows.to(tl.int64)[:, None] * channels + chans[None, :]  # out: [T, C] contiguous
    tl.store(out_at, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _conv_state_kernel(
    x,
    conv_state,
    slots,
    channels,
    stride_x,
    stride_ss,
    stride_sc,
    stride_sk,
    WIDTH: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    start, end, slot, carried = _span(slots)
    if end <= start:
        return
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_S)
    ok = (j < WIDTH - 1)[:, None] & (chans < channels)[None, :]
    window = end - start + j  # the new state's inputs: window positions n .. n + K - 2 of [saved | rows]
    from_rows = (window >= WIDTH - 1)[:, None]
    src = (start + window - (WIDTH - 1)).to(tl.int64)
    value = tl.load(x + src[:, None] * stride_x + chans[None, :], mask=ok & from_rows, other=0.0).to(tl.float32)
    base = conv_state + slot * stride_ss + chans[None, :] * stride_sc
    saved = tl.load(base + window.to(tl.int64)[:, None] * stride_sk, mask=ok & ~from_rows & carried, other=0.0)
    value += saved.to(tl.float32)
    tl.store(base + j[:, None] * stride_sk, value.to(conv_state.dtype.element_ty), mask=ok)


def causal_conv1d(x, weight, bias, conv_state, state_slots, query_start_loc, positions, silu) -> Tensor:
    """flare::causal_conv1d (arguments as its schema: helios.core.ops.recurrent)."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = state_slots.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    steps = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=x.device)
    token_seq = torch.searchsorted(query_start_loc[1:], steps, right=True)
    block_c = min(_pow2(channels), 64)
    layout = Slots(query_start_loc, state_slots, positions, conv_state.shape[0])
    sizes = (channels, x.stride(0))
    tensors = (x, weight, bias, conv_state, out, token_seq, layout, num_tokens, num_seqs)
    grid = (triton.cdiv(num_tokens, 16), triton.cdiv(channels, block_c))
    blocks = {"WIDTH": width, "BLOCK_C": block_c}
    _conv_kernel[grid](*tensors, *sizes, *weight.stride(), *conv_state.stride(), SILU=bool(silu), BLOCK_T=16, **blocks)
    if width > 1:  # after every row has read the old state
        grid = (num_seqs, triton.cdiv(channels, block_c))
        blocks["BLOCK_S"] = triton.next_power_of_2(width - 1)
        _conv_state_kernel[grid](x, conv_state, layout, *sizes, *conv_state.stride(), **blocks)
    return out


# ---------------------------------------------------------------------------------------------
# mamba2_scan


@triton.jit
def _ssm_kernel(
    x,
    steps,
    A,
    B,
    C,
    D,
    ssm_state,
    out,
    slots,
    heads,
    heads_per_group,
    dim,
    state_dim,
    stride_xt,
    stride_xh,
    stride_bt,
    stride_bg,
    state_strides,
    CHUNKED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start, end, slot, carried = _span(slots)
    if end <= start:
        return
    h = tl.program_id(1)
    group = h // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < dim, n < state_dim
    at, mask, state = _state_tile(ssm_state, state_strides, slot, p, n, p_ok, n_ok, carried)  # [P, N]
    a = tl.load(A + h).to(tl.float32)
    skip = tl.load(D + h).to(tl.float32)
    if CHUNKED:  # SSD: within a chunk one masked matrix product, the state passed from chunk to chunk
        r = tl.arange(0, CHUNK)
        causal = r[:, None] >= r[None, :]
        for c0 in range(start, end, CHUNK):
            rows = (c0 + r).to(tl.int64)
            r_ok = (c0 + r) < end
            x_at = rows[:, None] * stride_xt + h * stride_xh + p[None, :]
            xc = tl.load(x + x_at, mask=r_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)  # [L, P]
            dtc = tl.load(steps + rows * heads + h, mask=r_ok, other=0.0)  # [L], 0 past the end
            bc_at = rows[:, None] * stride_bt + group * stride_bg + n[None, :]
            bmask = r_ok[:, None] & n_ok[None, :]
            bc = tl.load(B + bc_at, mask=bmask, other=0.0).to(tl.float32)  # [L, N]
            cc = tl.load(C + bc_at, mask=bmask, other=0.0).to(tl.float32)
            log_decay = dtc * a
            cum = tl.cumsum(log_decay, axis=0)  # log-decay from the chunk's start through each row
            # decay[i, j] = exp(cum_i - cum_j) for j <= i: the product of the decays after row j through row i
            decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
            scores = tl.dot(cc, tl.trans(bc), input_precision="ieee")  # [L, L]: C_i . B_j
            y = tl.dot(scores * decay * dtc[None, :], xc, input_precision="ieee")
            y += tl.dot(cc, tl.trans(state), input_precision="ieee") * tl.exp(cum)[:, None]
            out_at = out + (rows[:, None] * heads + h) * dim + p[None, :]  # out: [T, H, P] contiguous
            tl.store(out_at, y + skip * xc, mask=r_ok[:, None] & p_ok[None, :])
            last = tl.sum(log_decay, axis=0)
            weight = tl.exp(last - cum) * dtc  # [L]
            state = state * tl.exp(last) + tl.dot(tl.trans(xc * weight[:, None]), bc, input_precision="ieee")
    else:  # token by token
        for t in range(start, end):
            xv = tl.load(x + t * stride_xt + h * stride_xh + p, mask=p_ok, other=0.0).to(tl.float32)
            step = tl.load(steps + t * heads + h)
            bv = tl.load(B + t * stride_bt + group * stride_bg + n, mask=n_ok, other=0.0).to(tl.float32)
            cv = tl.load(C + t * stride_bt + group * stride_bg + n, mask=n_ok, other=0.0).to(tl.float32)
            state = state * tl.exp(step * a) + (step * xv)[:, None] * bv[None, :]
            y = tl.sum(state * cv[None, :], axis=1) + skip * xv
            tl.store(out + (t * heads + h) * dim + p, y, mask=p_ok)
    tl.store(at, state.to(ssm_state.dtype.element_ty), mask=mask)


def mamba2_scan(
    x, dt, A, B, C, D, dt_bias, ssm_state, state_slots, query_start_loc, positions, dt_min=0.0, dt_max=0.0, *, form=None
) -> Tensor:
    """flare::mamba2_scan (arguments as its schema: helios.core.ops.mamba), chunked when the step has
    more rows than sequences (prefill), else token by token (decode); a `Form` forces one, as the
    tests do (both serve any layout)."""
    num_tokens, heads, dim = x.shape
    groups, state_dim = B.shape[1], B.shape[2]
    num_seqs = state_slots.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    chunked, chunk = form or Form(num_tokens > num_seqs)
    steps = time_steps(dt, dt_bias, dt_min, dt_max).contiguous()  # [T, H] fp32, elementwise on the device
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    if B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    block_p = min(_pow2(dim), VALUE_BLOCK)
    args = (x, steps, A, B, C, D, ssm_state, out, Slots(query_start_loc, state_slots, positions, ssm_state.shape[0]))
    shape = (heads, heads // groups, dim, state_dim, *x.stride()[:2], *B.stride()[:2], ssm_state.stride())
    grid = (num_seqs, heads, triton.cdiv(dim, block_p))
    blocks = {"CHUNK": chunk or SSM_CHUNK, "BLOCK_P": block_p, "BLOCK_N": _pow2(state_dim)}
    _ssm_kernel[grid](*args, *shape, CHUNKED=chunked, **blocks, num_warps=CHUNKED_WARPS if chunked else 4)
    return out


# ---------------------------------------------------------------------------------------------
# gated_delta_rule and kda


EPS: tl.constexpr = tl.constexpr(L2NORM_EPS)  # inside the root of transformers' l2norm


@triton.jit
def _row_scale(x, NORM: tl.constexpr):
    """The factor [R] that L2-normalizes each row of x [R, D] fp32 (transformers' l2norm, eps inside
    the root) when NORM, else ones."""
    if NORM:
        factor = tl.rsqrt(tl.sum(x * x, axis=1) + EPS)
    else:
        factor = tl.sum(x * 0.0, axis=1) + 1.0
    return factor


@triton.jit
def _unit_lower_inverse(a, CHUNK: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular [CHUNK, CHUNK] a, by forward substitution:
    row i = e_i - sum_{j < i} a[i, j] row j."""
    r = tl.arange(0, CHUNK)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, CHUNK):
        a_row = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)  # a[i, :], zero from column i on
        row = tl.where(r == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inv, axis=0)
        inv = tl.where(r[:, None] == i, row[None, :], inv)
    return inv


@triton.jit
def _kda_pairs(
    q_rows,
    k_rows,
    g_rows,
    r_ok,
    q_scale,
    k_scale,
    beta,
    causal,
    k_dim,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """KDA's pairwise terms of a chunk, [CHUNK, CHUNK] each, with decay_ijd = exp(cum_id - cum_jd) for
    j <= i taken explicitly over key-channel blocks of SUB (no exp(-cum) factor that could overflow):
    system_ij = sum_d beta_i k_id k_jd decay_ijd, attn_ij = sum_d q_id k_jd decay_ijd (scaled rows)."""
    system = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    attn = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_K, SUB):
        sd = d0 + tl.arange(0, SUB)
        mask = r_ok[:, None] & (sd < k_dim)[None, :]
        q_sub = tl.load(q_rows + sd[None, :], mask=mask, other=0.0).to(tl.float32) * q_scale[:, None]
        k_sub = tl.load(k_rows + sd[None, :], mask=mask, other=0.0).to(tl.float32) * k_scale[:, None]
        cum = tl.cumsum(tl.load(g_rows + sd[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
        pair = tl.where(causal[:, :, None], cum[:, None, :] - cum[None, :, :], float("-inf"))
        k_pair = k_sub[None, :, :] * tl.exp(pair)  # [L(i), L(j), SUB]: k_j decayed to row i
        system += tl.sum((k_sub * beta[:, None])[:, None, :] * k_pair, axis=2)
        attn += tl.sum(q_sub[:, None, :] * k_pair, axis=2)
    return system, attn


@triton.jit
def _delta_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    out,
    slots,
    value_heads,
    group,
    k_dim,
    v_dim,
    scale,
    stride_qt,
    stride_qh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    state_strides,
    NORM: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    CHUNKED: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    start, end, slot, carried = _span(slots)
    if end <= start:
        return
    h = tl.program_id(1)
    kh = h // group
    kd = tl.arange(0, BLOCK_K)
    vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kd < k_dim, vd < v_dim
    at, mask, s = _state_tile(state, state_strides, slot, kd, vd, k_ok, v_ok, carried)  # [K, V]
    if CHUNKED:  # the WY / UT form, CHUNK rows at a time
        r = tl.arange(0, CHUNK)
        lower = r[:, None] > r[None, :]
        causal = r[:, None] >= r[None, :]
        for c0 in range(start, end, CHUNK):
            rows = (c0 + r).to(tl.int64)
            r_ok = (c0 + r) < end
            qk_rows = rows[:, None] * stride_qt + kh * stride_qh
            qk_mask = r_ok[:, None] & k_ok[None, :]
            qc = tl.load(q + qk_rows + kd[None, :], mask=qk_mask, other=0.0).to(tl.float32)  # [L, K]
            kc = tl.load(k + qk_rows + kd[None, :], mask=qk_mask, other=0.0).to(tl.float32)
            q_scale = _row_scale(qc, NORM) * scale  # [L]
            k_scale = _row_scale(kc, NORM)
            qc, kc = qc * q_scale[:, None], kc * k_scale[:, None]
            v_at = rows[:, None] * stride_vt + h * stride_vh + vd[None, :]
            vc = tl.load(v + v_at, mask=r_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)  # [L, V]
            bc = tl.load(beta + rows * value_heads + h, mask=r_ok, other=0.0).to(tl.float32)  # [L], 0 past the end
            kb = kc * bc[:, None]
            g_rows = g + rows[:, None] * stride_gt + h * stride_gh
            if PER_CHANNEL:  # KDA: log decays per key channel, cum [L, K]
                gc = tl.load(g_rows + kd[None, :], mask=qk_mask, other=0.0).to(tl.float32)
                cum = tl.cumsum(gc, axis=0)
                last = tl.sum(gc, axis=0)  # [K]: the chunk's whole log decay (rows past the end add 0)
                system, attn = _kda_pairs(
                    q + qk_rows, k + qk_rows, g_rows, r_ok, q_scale, k_scale, bc, causal, k_dim, CHUNK, SUB, BLOCK_K
                )
                system = tl.where(lower, system, 0.0)
                decay_rows = tl.exp(cum)  # [L, K]
                tail = tl.exp(last[None, :] - cum)
                s_decay = tl.exp(last)[:, None]  # [K, 1]
            else:  # gated DeltaNet: one log decay per head and row
                # The scan runs over the [L] vector: triton 3.6 (torch 2.11's, the GPU hosts') fails an
                # assertion lowering a cumsum over an [L, 1] block for sm_90 at 8 warps.
                gv = tl.load(g + rows * stride_gt + h * stride_gh, mask=r_ok, other=0.0).to(tl.float32)  # [L]
                gc = gv[:, None]  # [L, 1]
                cum = tl.cumsum(gv, axis=0)[:, None]  # [L, 1]
                last = tl.sum(gc, axis=0)  # [1]
                decay = tl.exp(tl.where(causal, cum - tl.trans(cum), float("-inf")))  # [L, L], i >= j
                system = tl.where(lower, tl.dot(kb, tl.trans(kc), input_precision="ieee") * decay, 0.0)
                attn = tl.dot(qc, tl.trans(kc), input_precision="ieee") * decay
                decay_rows = tl.exp(cum)  # [L, 1]
                tail = tl.exp(last[None, :] - cum)
                s_decay = tl.exp(last)[:, None]  # [1, 1]
            # (I + strictly_lower(beta_i k_i . k_j decay_ij)) [u | w] = [v beta | k beta exp(cum)]
            inverse = _unit_lower_inverse(system, CHUNK)
            u = tl.dot(inverse, vc * bc[:, None], input_precision="ieee")  # [L, V]
            w = tl.dot(inverse, kb * decay_rows, input_precision="ieee")  # [L, K]
            v_new = u - tl.dot(w, s, input_precision="ieee")  # what each write adds beyond the old state's prediction
            o = tl.dot(qc * decay_rows, s, input_precision="ieee") + tl.dot(attn, v_new, input_precision="ieee")
            out_at = out + (rows[:, None] * value_heads + h) * v_dim + vd[None, :]  # out: [T, Hv, Dv] contiguous
            tl.store(out_at, o, mask=r_ok[:, None] & v_ok[None, :])
            s = s * s_decay + tl.dot(tl.trans(kc * tail), v_new, input_precision="ieee")
    else:  # token by token
        for t in range(start, end):
            qv = tl.load(q + t * stride_qt + kh * stride_qh + kd, mask=k_ok, other=0.0).to(tl.float32)
            kv = tl.load(k + t * stride_qt + kh * stride_qh + kd, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + EPS)
                kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + EPS)
            qv = (qv * scale)[:, None]  # [K, 1]
            kv = kv[:, None]
            vv = tl.load(v + t * stride_vt + h * stride_vh + vd, mask=v_ok, other=0.0).to(tl.float32)
            b = tl.load(beta + t * value_heads + h).to(tl.float32)
            if PER_CHANNEL:
                gate = tl.load(g + t * stride_gt + h * stride_gh + kd, mask=k_ok, other=0.0).to(tl.float32)
                s = s * tl.exp(gate)[:, None]
            else:
                s = s * tl.exp(tl.load(g + t * stride_gt + h * stride_gh).to(tl.float32))
            delta = (vv - tl.sum(s * kv, axis=0)) * b
            s = s + kv * delta[None, :]
            o = tl.sum(s * qv, axis=0)
            tl.store(out + (t * value_heads + h) * v_dim + vd, o, mask=v_ok)
    tl.store(at, s.to(state.dtype.element_ty), mask=mask)


def delta_rule(
    q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, *, form=None
) -> Tensor:
    """flare::gated_delta_rule (g [T, Hv]) and flare::kda (g [T, H, Dk]): one schema (helios.core.ops
    .gated_delta, .glm5_next), the gate's shape tells them apart. Chunked when the step has more rows
    than sequences (prefill), else token by token (decode); a `Form` forces one, as the tests do
    (both serve any layout)."""
    num_tokens, value_heads, v_dim = v.shape
    key_heads, k_dim = k.shape[1], k.shape[2]
    per_channel = g.dim() == 3
    num_seqs = state_slots.shape[0]
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    chunked, chunk = form or Form(num_tokens > num_seqs)
    q, k, v, g = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    beta = beta.contiguous()
    block_k = _pow2(k_dim)
    block_v = min(_pow2(v_dim), VALUE_BLOCK)
    layout = Slots(query_start_loc, state_slots, positions, state.shape[0])
    args = (q, k, v, g, beta, state, out, layout, value_heads, value_heads // key_heads, k_dim, v_dim, float(scale))
    strides = (*q.stride()[:2], *v.stride()[:2], *g.stride()[:2], state.stride())
    grid = (num_seqs, value_heads, triton.cdiv(v_dim, block_v))
    flags = {"NORM": bool(qk_l2norm), "PER_CHANNEL": per_channel, "BLOCK_K": block_k, "BLOCK_V": block_v}
    flags |= {"CHUNKED": chunked, "CHUNK": chunk or (KDA_CHUNK if per_channel else DELTA_CHUNK)}
    flags |= {"SUB": min(KDA_SUB, block_k), "num_warps": CHUNKED_WARPS if chunked else 4}
    _delta_kernel[grid](*args, *strides, **flags)
    return out


gated_delta_rule = kda = delta_rule


def register(library: torch.library.Library) -> None:
    """Install this family's kernels into the flare IMPL library's CUDA slot."""
    library.impl("causal_conv1d", causal_conv1d, "CUDA")
    library.impl("mamba2_scan", mamba2_scan, "CUDA")
    library.impl("gated_delta_rule", delta_rule, "CUDA")
    library.impl("kda", delta_rule, "CUDA")
