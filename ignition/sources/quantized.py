"""Quantized Hugging Face checkpoints, dequantized at export.

Cores store float weights, so a quantized checkpoint is expanded once, here, and the
manifest records what it was (`SourceIdentity.format`). The formats the recipes' published
checkpoints ship:

* **FP8, block-scaled** (`quant_method = "fp8"`, DeepSeek-V3 / Kimi / GLM style): `W` is
  float8_e4m3fn and `W_scale_inv` holds one multiplier per `weight_block_size` block
  (fp32, or UE8M0 exponents as float8_e8m0fnu / uint8). Partial edge blocks use the scale
  of the block they start in.
* **NVFP4, ModelOpt** (`quant_method = "modelopt"`, `quant_algo = "NVFP4"`): `W` packs two
  E2M1 values per byte (the even element in the low nibble), `W_scale` is one
  float8_e4m3fn scale per 16 values along the input dim, `W_scale_2` a per-tensor fp32
  multiplier: value = e2m1 * scale * scale_2. `input_scale` (activations) is dropped.
* **compressed-tensors** (`quant_method = "compressed-tensors"`): `nvfp4-pack-quantized`
  (`W_packed`, `W_scale`, `W_global_scale`: value = e2m1 * scale / global_scale) and
  `float-quantized` FP8 (`W`, `W_scale` per tensor, channel or block).

Anything else that declares a quantization_config is refused by name, never read as floats.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ignition.errors import SourceError

# E2M1 (FP4) code points 0..15: sign bit 3, then two exponent bits and one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_GROUP = 16  # values per float8 scale
ACTIVATION_SCALES = ("input_scale", "k_scale", "v_scale", "output_scale", "input_global_scale")


def unpack_e2m1(packed: Tensor) -> Tensor:
    """[..., K/2] bytes -> [..., K] float32: element 2i is byte i's low nibble, 2i+1 its high nibble."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    raw = packed.contiguous().view(torch.uint8).long()
    pairs = torch.stack((table[raw & 0xF], table[raw >> 4]), dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _scale_values(scale: Tensor) -> Tensor:
    """Block scales as float32 multipliers: UE8M0 exponents (uint8 or float8_e8m0fnu) are 2**(e - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize_fp8_blocks(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] | None = None) -> Tensor:
    """An FP8 matrix [N, K] (or a stack [..., N, K]) times its block scales [..., ceil(N/bn), ceil(K/bk)].

    `block` is the checkpoint's weight_block_size; without one (compressed-tensors, ModelOpt)
    the grid must divide the matrix exactly, which also reads per-tensor [1, 1] or scalar and
    per-channel [N, 1] scales."""
    values, scale = weight.float(), _scale_values(scale_inv)
    if scale.numel() == 1:
        return values * scale.reshape(())
    rows, cols = values.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:]
    if block is None:
        if rows % scale_rows or cols % scale_cols:
            raise ValueError(f"weight {tuple(values.shape)} is not divisible by its scale grid {tuple(scale.shape)}")
        block = (rows // scale_rows, cols // scale_cols)
    block_rows, block_cols = block
    if (-(-rows // block_rows), -(-cols // block_cols)) != (scale_rows, scale_cols):
        raise ValueError(
            f"weight {tuple(values.shape)} does not fit {block_rows}x{block_cols} blocks of scales {tuple(scale.shape)}"
        )
    grid = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :].repeat_interleave(block_cols, dim=-1)
    return values * grid[..., :cols]


def dequantize_nvfp4(packed: Tensor, scale: Tensor, multiplier: Tensor) -> Tensor:
    """Packed E2M1 [..., N, K/2] with float8 group scales [..., N, K/16] and a per-tensor fp32 multiplier."""
    values = unpack_e2m1(packed)
    groups = scale.float().repeat_interleave(NVFP4_GROUP, dim=-1)
    if groups.shape != values.shape:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit group scales {tuple(scale.shape)}")
    factor = multiplier.float()
    factor = factor.reshape(()) if factor.numel() == 1 else factor.reshape(*factor.shape, 1, 1)  # per expert
    return values * groups * factor


# ---------------------------------------------------------------------------- formats


def source_format(config: dict[str, Any]) -> str | None:
    """The quantized format a config.json declares (None: plain floats); refuses unknown ones."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        block = quant.get("weight_block_size")
        return "fp8-e4m3" + (f" blocks {block[0]}x{block[1]}" if isinstance(block, list) and len(block) == 2 else "")
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "nvfp4 (modelopt)"
        if algo == "FP8":
            return "fp8-e4m3 per-tensor (modelopt)"
        raise SourceError(f"ModelOpt quantization {algo or '?'} is not supported (supported: NVFP4, FP8)")
    if method == "compressed-tensors":
        formats = _compressed_formats(quant)
        unknown = formats - {"nvfp4-pack-quantized", "float-quantized", "dense"}
        if unknown:
            raise SourceError(
                f"compressed-tensors format {', '.join(sorted(unknown))} is not supported "
                "(supported: nvfp4-pack-quantized, float-quantized)"
            )
        return "compressed-tensors " + "+".join(sorted(formats - {"dense"}))
    raise SourceError(
        f"checkpoint quantization {method or '?'!r} is not supported (supported: fp8, modelopt NVFP4/FP8, "
        "compressed-tensors nvfp4-pack-quantized/float-quantized); export from the unquantized checkpoint"
    )


def _compressed_formats(quant: dict[str, Any]) -> set[str]:
    groups = quant.get("config_groups") or {}
    formats = {str(g.get("format")) for g in groups.values() if isinstance(g, dict) and g.get("format")}
    return formats or {str(quant.get("format") or "dense")}


def dequantize(tensors: dict[str, Tensor], config: dict[str, Any]) -> dict[str, Tensor]:
    """The checkpoint's tensors with every quantized weight replaced by its float32 value and
    every scale tensor consumed; plain checkpoints come back unchanged (as float32). Integer
    tables that are not packed weights (DeepSeek-V4's token -> expert ids) keep their dtype."""
    if source_format(config) is None:
        return {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}
    block = config["quantization_config"].get("weight_block_size")
    fp8_blocks = partial(
        dequantize_fp8_blocks, block=tuple(block) if isinstance(block, list) and len(block) == 2 else None
    )
    out: dict[str, Tensor] = {}
    consumed: set[str] = set()
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        prefix = module + "." if module else ""
        rule = _rule_for(leaf, prefix, tensors, fp8_blocks)
        if rule is None:
            continue
        target, inputs, function = rule
        try:
            out[prefix + target] = function(*(tensors[prefix + i] for i in inputs))
        except (ValueError, RuntimeError) as exc:
            raise SourceError(f"cannot dequantize {prefix + target!r}: {exc}") from exc
        consumed.update(prefix + i for i in inputs)
    for name, tensor in tensors.items():
        if name in consumed or name in out or name.rpartition(".")[2] in ACTIVATION_SCALES:
            continue  # activation scales: meaningless for float weights
        if tensor.dtype in (*_FP8_DTYPES, torch.uint8, torch.int8):  # packed or quantized bytes
            raise SourceError(f"tensor {name!r} is stored as {tensor.dtype} with no scale to dequantize it by")
        out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))
_SCALE_SUFFIXES = ("_scale_inv", "_global_scale", "_scale_2", "_scale")

Rule = tuple[str, tuple[str, ...], Callable[..., Tensor]]


def _rule_for(leaf: str, prefix: str, tensors: dict[str, Tensor], fp8_blocks: Callable[..., Tensor]) -> Rule | None:
    """How the tensor `prefix + leaf` is dequantized: (its float tensor's leaf, the input leaves,
    the function); None for scales and plain tensors."""

    def has(*leaves: str) -> bool:
        return all(prefix + item in tensors for item in leaves)

    if leaf.endswith("_packed"):  # compressed-tensors NVFP4
        base = leaf.removesuffix("_packed")
        if has(base + "_scale", base + "_global_scale"):
            return base, (leaf, base + "_scale", base + "_global_scale"), _nvfp4_over_global
        return None
    if leaf.endswith(_SCALE_SUFFIXES) or leaf in ACTIVATION_SCALES:
        return None
    dtype = tensors[prefix + leaf].dtype
    if dtype == torch.uint8 and has(leaf + "_scale", leaf + "_scale_2"):  # ModelOpt NVFP4
        return leaf, (leaf, leaf + "_scale", leaf + "_scale_2"), dequantize_nvfp4
    if has(leaf + "_scale_inv"):  # block-scaled FP8
        return leaf, (leaf, leaf + "_scale_inv"), fp8_blocks
    if dtype in _FP8_DTYPES and has(leaf + "_scale"):  # compressed-tensors / ModelOpt FP8
        return leaf, (leaf, leaf + "_scale"), dequantize_fp8_blocks
    return None


def _nvfp4_over_global(packed: Tensor, scale: Tensor, global_scale: Tensor) -> Tensor:
    """compressed-tensors stores the reciprocal of ModelOpt's scale_2."""
    return dequantize_nvfp4(packed, scale, 1.0 / global_scale.float())
