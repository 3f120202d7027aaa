"""The plain-torch reference of helios' int8-activation quantized linears (native/linear_qa.h).

A core exported with `--quant-activations int8` runs its quantized linears on activations
quantized per row, per block of 32 input features, to int8 with one float32 scale, as llama.cpp's
Q8_0 does: d = amax / 127 (float32), q = round-to-nearest-even(x / d), q = 0 where amax is 0. The
product is then the weights' stored integers times those, summed per block exactly, scaled by the
weight group's scale and the block's d, plus (int4) the group's minimum times d * sum(q). This
module computes that in float64 from helios.core.quant's stored tensors: what the native kernel's
float32 steps round (tests/engine/test_qlinear_native.py bounds the difference), and what the
export's self-check compares against where the native kernels are absent.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core import quant

ACT_BLOCK = 32  # input features per activation scale


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., in] (in a multiple of 32) -> (q [..., in / 32, 32] int8 values as float32, d [..., in / 32])."""
    if x.shape[-1] % ACT_BLOCK:
        raise ValueError(f"int8 activations need an input size that is a multiple of {ACT_BLOCK}, not {x.shape[-1]}")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // ACT_BLOCK, ACT_BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    nonzero = d > 0
    q = torch.round(blocks / torch.where(nonzero, d, torch.ones_like(d))[..., None]).clamp_(-127, 127)
    return torch.where(nonzero[..., None], q, torch.zeros_like(q)), d


def fake_quantize(x: Tensor) -> Tensor:
    """x with each 32-feature block replaced by q * d (its int8 quantization, dequantized), in x's
    dtype: a float linear of this by the dequantized weights is the int8-activation product up to
    float rounding (the export's self-check runs its programs so)."""
    q, d = quantize_activations(x)
    return (q * d[..., None]).reshape(x.shape).to(x.dtype)


def terms(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, group: int) -> tuple[Tensor, Tensor | None]:
    """Per row, output and activation block, in float64: the scaled block products
    s * d * sum(w_q * x_q) [rows, out, in / 32], and (int4) the minimum terms m * d * sum(x_q)."""
    q, d = quantize_activations(x.reshape(-1, x.shape[-1]))
    w = (quant.unpack_int4(qweight) if mins is not None else qweight).double()
    w = w.reshape(w.shape[0], -1, ACT_BLOCK)  # [out, blocks, 32]
    dots = torch.einsum("rkf,nkf->rnk", q.double(), w)  # exact: integers below 2^53
    per_block = group // ACT_BLOCK
    s = scales.double().repeat_interleave(per_block, -1)  # [out, blocks]
    main = dots * s[None] * d.double()[:, None, :]
    if mins is None:
        return main, None
    m = mins.double().repeat_interleave(per_block, -1)
    return main, m[None] * (d.double() * q.double().sum(-1))[:, None, :]


def qlinear_a8(
    x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, group: int, bias: Tensor | None = None
) -> Tensor:
    """The int8-activation linear of x [..., in] by a stored quantized weight [out, in]: float64
    arithmetic, rounded once to x's dtype."""
    main, low = terms(x, qweight, scales, mins, group)
    y = main.sum(-1) + (low.sum(-1) if low is not None else 0.0)
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
