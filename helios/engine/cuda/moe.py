"""flare::routed_experts on CUDA: one grouped GEMM over every expert's routed rows (vLLM's fused_moe
layout), not a loop over experts.

1. Alignment (`align_by_expert`, shape-static torch on the device): the num_tokens * top_k
   (token, expert) assignments are sorted by expert (stable) and laid out in `sorted_ids`, each
   expert's run padded to a multiple of BLOCK_M with the sentinel `num_assignments`; `block_experts`
   names the expert of each BLOCK_M block (num_experts past the end: such blocks exit at once).
   Its length is bounded by shapes alone: num_assignments + min(num_assignments, num_experts) *
   (BLOCK_M - 1) rows, since only experts with rows pad.
2. `_expert_gemm_kernel` twice, one grouped GEMM kernel for both projections; a program takes one
   BLOCK_M block of an expert's assignments and BLOCK_N output columns:
   - gate/up, grid (blocks, cdiv(F, BLOCK_N)): a block's rows of h (token = id // top_k) times its
     expert's gate and up rows (two fp32 accumulators over the same F columns; one for the
     ungated relu2), rounded to the weights' dtype as the reference's matmul output is, the gated
     activation applied in fp32, stored to `act[assignment]` in the weights' dtype;
   - down, grid (blocks, cdiv(hidden, BLOCK_N)): act rows times the expert's down matrix, rounded
     to the weights' dtype, scaled by the routing weight, stored fp32 to `y[assignment]`.
3. The combine: y viewed [num_tokens, top_k, hidden] summed over top_k (deterministic: no atomics).
   With post_norm_scale (Muse Spark) the kernel leaves y unweighted and the scale, RMS norm and
   routing weight follow as torch elementwise ops.

Nothing reads a tensor's value on the host: grids come from shapes, so the op is capturable.
Matmul inputs are in the weights' dtype with fp32 accumulation (tl.dot in IEEE fp32 for fp32
weights, no TF32), as helios.core.ops.moe computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from helios.core.ops.moe import ACTIVATIONS, post_expert_norm


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _activate(gate, up, limit, alpha, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """One of helios.core.ops.moe.ACTIVATIONS (by index) over fp32 tiles; relu2 reads `gate` only."""
    if ACTIVATION == 0:  # silu
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * _sigmoid(gate) * up
    elif ACTIVATION == 1:  # silu_clamp_after
        act = gate * _sigmoid(gate)
        if CLAMP:
            act = tl.minimum(act, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = act * up
    elif ACTIVATION == 2:  # clamped_glu
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * _sigmoid(gate * alpha) * (up + 1.0)
    elif ACTIVATION == 3:  # gelu_tanh, tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) <= 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(inner))
        tanh = (1.0 - e) / (1.0 + e)
        out = 0.5 * gate * (1.0 + tl.where(inner < 0, -tanh, tanh)) * up
    else:  # relu2 (ungated)
        relu = tl.maximum(gate, 0.0)
        out = relu * relu
    return out


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_assignments,
    num_experts,
    k_dim,
    n_dim,
    rows_per_a,
    stride_a,
    stride_we,
    stride_wn,
    stride_wk,
    limit,
    alpha,
    ACTIVATION: tl.constexpr,
    CLAMP: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[assignment, cols] for a block of one expert's assignments: row assignment // rows_per_a of
    a [*, k_dim] times the expert's [n_dim, k_dim] rows of w (and, GATED, its up rows n_dim further),
    rounded to the weights' dtype, then the activation ACTIVATION (-1: none) and, WEIGHTED, the
    routing weight, in fp32. Serves both projections: gate/up (a = h, rows_per_a = top_k) and
    down (a = act, one row per assignment)."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert >= num_experts:  # a block past the last expert's rows
        return
    ids = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = ids < num_assignments  # the rest pad the expert's run
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_dim
    a_rows = a_ptr + (ids // rows_per_a)[:, None] * stride_a
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = (k0 + ks) < k_dim
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        a = a.to(w_ptr.dtype.element_ty)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_offsets = (k0 + ks)[:, None] * stride_wk + cols[None, :] * stride_wn
        acc += tl.dot(a, tl.load(w_base + w_offsets, mask=w_mask, other=0.0), input_precision="ieee")
        if GATED:
            up = tl.load(w_base + n_dim * stride_wn + w_offsets, mask=w_mask, other=0.0)
            up_acc += tl.dot(a, up, input_precision="ieee")
    # the reference's matmul output is in the weights' dtype; what follows runs in fp32
    y = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    if ACTIVATION >= 0:
        y = _activate(y, up_acc.to(w_ptr.dtype.element_ty).to(tl.float32), limit, alpha, ACTIVATION, CLAMP)
    if WEIGHTED:
        y = y * tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
    out_at = out_ptr + ids[:, None] * n_dim + cols[None, :]
    tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def align_by_expert(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Sort the assignments (flattened expert_ids) by expert, each expert's run padded to BLOCK_M.

    Returns (sorted_ids [blocks * block_m] int32: assignment index, or num_assignments = padding;
    block_experts [blocks] int64: each block's expert, num_experts = past the end). Shape-static:
    blocks = cdiv(A + min(A, E) * (block_m - 1), block_m) for A assignments and E experts.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    assignments = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first sorted assignment
    sorted_experts = flat[order]
    rank = torch.arange(assignments, device=device) - first[sorted_experts]
    destination = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    blocks = triton.cdiv(assignments + min(assignments, num_experts) * (block_m - 1), block_m)
    sorted_ids = torch.full((blocks * block_m,), assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_ids, block_experts


def _blocks(assignments: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by shape: few rows per expert (decode) take narrow row
    blocks; wide ones 8 warps (the gated kernel's two [64, 64] fp32 accumulators, without spills)."""
    block_m = 16 if assignments <= 4 * num_experts else 64
    return block_m, 64, 64 if dtype != torch.float32 else 32, 4 if block_m == 16 else 8


def routed_experts(
    h,
    expert_weights,
    expert_ids,
    w_gate_up,
    w_down,
    activation="silu",
    limit=0.0,
    alpha=1.0,
    post_norm_scale=None,
    post_norm_eps=1e-6,
):
    """flare::routed_experts (arguments as its schema: helios.core.ops.moe) as a grouped GEMM."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    num_tokens, top_k = expert_ids.shape
    hidden = h.shape[-1]
    num_experts = w_gate_up.shape[0]
    ffn = w_down.shape[2]
    assignments = num_tokens * top_k
    if assignments == 0:
        return torch.zeros(num_tokens, hidden, dtype=torch.float32, device=h.device)
    wdt = w_gate_up.dtype
    block_m, block_n, block_k, warps = _blocks(assignments, num_experts, wdt)
    sorted_ids, block_experts = align_by_expert(expert_ids, num_experts, block_m)
    blocks = block_experts.shape[0]
    x = h if h.stride(-1) == 1 else h.contiguous()
    act = torch.empty(assignments, ffn, dtype=wdt, device=h.device)
    weights = expert_weights.reshape(-1).float().contiguous()
    y = torch.empty(assignments, hidden, dtype=torch.float32, device=h.device)
    plan = (weights, sorted_ids, block_experts, assignments, num_experts)
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps}
    options = (float(limit), float(alpha))
    gate_up = {"ACTIVATION": ACTIVATIONS.index(activation), "CLAMP": limit > 0, "GATED": activation != "relu2"}
    gate_up["WEIGHTED"] = False
    _expert_gemm_kernel[(blocks, triton.cdiv(ffn, block_n))](
        x, w_gate_up, act, *plan, hidden, ffn, top_k, x.stride(0), *w_gate_up.stride(), *options, **gate_up, **config
    )
    down = {"ACTIVATION": -1, "CLAMP": False, "GATED": False, "WEIGHTED": post_norm_scale is None}
    _expert_gemm_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, w_down, y, *plan, ffn, hidden, 1, act.stride(0), *w_down.stride(), *options, **down, **config
    )
    if post_norm_scale is not None:  # Muse Spark: scale, RMS-normalize, then the routing weight
        y = post_expert_norm(y, post_norm_scale, post_norm_eps) * weights[:, None]
    return y.view(num_tokens, top_k, hidden).sum(1)


def register(library: torch.library.Library) -> None:
    """Install this family's kernels into the flare IMPL library's CUDA slot."""
    library.impl("routed_experts", routed_experts, "CUDA")
