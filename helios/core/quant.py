"""Quantized weights in a Flare core: the stored layout, and its plain-torch quantize/dequantize.

A quantized weight `name` of shape [..., out, in] (a linear's weight, or a stack of experts'
weights with leading dims) is not stored under its own name. Its values are split along the
input dimension into groups of `group` (32, 64 or 128) consecutive elements, and the weights file
holds instead:

* int8 (symmetric): `name.qweight` int8 [..., out, in], q in [-127, 127];
  `name.scales` [..., out, in / group]. Value = q * scale.
* int4 (scale and minimum): `name.qweight` uint8 [..., out, in / 2], two values per byte: element
  2j in the low nibble of byte j, element 2j + 1 in the high nibble, q in [0, 15];
  `name.scales` and `name.mins` [..., out, in / group]. Value = q * scale + min.

Scales (and minimums) are float32, bfloat16 or float16 (manifest: scale_dtype; float16, as GGUF's
Q8_0 and Q4_0 store theirs, needs core format version 4). Value arithmetic is
float32: a weight's float reference is `dequantize(...)` in float32, and helios' kernels compute
linears against exactly these values (accumulating in float32). GGUF blocks map onto the layout
without requantizing: Q8_0 is int8 with group 32, Q4_0 is int4 with min = -8 * scale, Q4_1 is
int4 as is, and Q4_K's sub-blocks of 32 give scale = d * sc and min = -dmin * m (float32 products
of float16 and 6-bit integers, exact).
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8, INT4 = "int8", "int4"
FORMATS = (INT8, INT4)
GROUPS = (32, 64, 128)
SCALE_DTYPES = ("float32", "bfloat16", "float16")
QWEIGHT, SCALES, MINS = ".qweight", ".scales", ".mins"
# What a quantized weight's linears multiply it by (manifest QuantizedTensor.activations): the float
# activations as they are, or int8 ones (Q8_0-style per 32-feature block, helios.engine.quantized_ref).
FLOAT_ACTIVATIONS, INT8_ACTIVATIONS = "float", "int8"
ACTIVATIONS = (FLOAT_ACTIVATIONS, INT8_ACTIVATIONS)


def stored_names(name: str, fmt: str) -> tuple[str, ...]:
    """The weights-file tensors that hold quantized weight `name`."""
    return (name + QWEIGHT, name + SCALES, name + MINS) if fmt == INT4 else (name + QWEIGHT, name + SCALES)


def level(fmt: str, group: int, activations: str = FLOAT_ACTIVATIONS) -> str:
    """The short precision name users see (Ollama's quantization_level), e.g. 'int4-g64', or
    'int8-g32-a8' where the linears run on int8 activations."""
    return f"{fmt}-g{group}" + ("-a8" if activations == INT8_ACTIVATIONS else "")


def check_shape(shape: tuple[int, ...], group: int) -> None:
    if len(shape) < 2 or shape[-1] % group:
        raise ValueError(f"a weight of shape {tuple(shape)} cannot be quantized in groups of {group} along its inputs")


def pack_int4(q: Tensor) -> Tensor:
    """uint8 values 0..15 [..., in] (in even) -> uint8 [..., in / 2], low nibble first."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., in / 2] -> uint8 values 0..15 [..., in]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _grouped(w: Tensor, group: int) -> Tensor:
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // group, group)


def quantize_int8(w: Tensor, group: int, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Symmetric group-wise int8: (qweight int8 [..., out, in], scales [..., out, in / group])."""
    check_shape(tuple(w.shape), group)
    g = _grouped(w, group)
    scales = (g.abs().amax(-1) / 127.0).to(scale_dtype)
    s = scales.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale, q = 0
    q = torch.round(g / s[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scales


def quantize_int4(w: Tensor, group: int, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise int4 with a scale and a minimum (value = q * scale + min, q in 0..15), computed
    against the stored (rounded) scale and minimum: (qweight uint8 [..., out, in / 2], scales, mins)."""
    check_shape(tuple(w.shape), group)
    g = _grouped(w, group)
    lo, hi = g.amin(-1), g.amax(-1)
    mins = lo.to(scale_dtype)
    scales = ((hi - mins.float()) / 15.0).to(scale_dtype)
    s = scales.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((g - mins.float()[..., None]) / s[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(w.shape)), scales, mins


def quantize(w: Tensor, fmt: str, group: int, scale_dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The stored tensors of `w` quantized as `fmt`, keyed by suffix (QWEIGHT, SCALES[, MINS])."""
    if fmt == INT8:
        q, scales = quantize_int8(w, group, scale_dtype)
        return {QWEIGHT: q, SCALES: scales}
    if fmt == INT4:
        q, scales, mins = quantize_int4(w, group, scale_dtype)
        return {QWEIGHT: q, SCALES: scales, MINS: mins}
    raise ValueError(f"unknown weight format {fmt!r}: choose one of {', '.join(FORMATS)}")


def dequantize(
    qweight: Tensor, scales: Tensor, mins: Tensor | None, group: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The float weight [..., out, in] the stored tensors stand for (float32 arithmetic, then `dtype`)."""
    q = unpack_int4(qweight) if mins is not None else qweight
    g = q.float().reshape(*q.shape[:-1], q.shape[-1] // group, group) * scales.float()[..., None]
    if mins is not None:
        g = g + mins.float()[..., None]
    return g.reshape(q.shape).to(dtype)


def stored_bytes(shape: tuple[int, ...], fmt: str, group: int, scale_dtype: torch.dtype) -> int:
    """Bytes the stored tensors of one quantized weight take (decode_weight_bytes counts these)."""
    count = 1
    for dim in shape:
        count *= dim
    groups = count // group * torch.empty((), dtype=scale_dtype).element_size()
    return (count if fmt == INT8 else count // 2) + groups * (2 if fmt == INT4 else 1)
