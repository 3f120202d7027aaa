"""The quantization grids of a GGUF file's quantized tensors, for exports that keep them.

A GGUF source is read as float32 values (gguf_source.read_gguf). An export with --quantize can
store Q8_0, Q4_0, Q4_1 and Q4_K tensors on their own grid instead of requantizing them
(helios.core.quant: Q8_0 -> int8 group 32; Q4_0 -> int4 with min = -8 * d; Q4_1 -> int4 with
its d and m; Q4_K -> int4 groups of 32 with scale = d * sc and min = -dmin * m, float32).

The family's conversions (llama.cpp's q/k row permutation undone, q/k/v or gate/up fused along
the outputs, experts stacked) move whole rows. So the grid travels as one int32 map per tensor
in the tensor's (Hugging Face) shape holding the id of the 32-value group each element belongs
to (-1: not quantized in the file), converted exactly like the values; the export reads each
weight's groups back from its map and checks that the grid reproduces the values exactly
(ignition.quantize). Per-group tables, indexed by id, hold the scale, the minimum and the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # every kept grid has 32 values per scale
NONE, INT8, INT4 = 0, 8, 4  # per-group kinds: 0 = quantized in the file, but with no core layout (Q5_K, Q6_K, ...)
KEPT = {"Q8_0": INT8, "Q4_0": INT4, "Q4_1": INT4, "Q4_K": INT4}


@dataclass(frozen=True)
class SourceGrids:
    """Group ids per element of each quantized source tensor, and per-group tables."""

    ids: dict[str, Tensor]  # Hugging Face name -> int32 [..., in] group id of each element
    scales: Tensor  # float32 [groups] (NaN for kind NONE)
    mins: Tensor  # float32 [groups] (0 for int8)
    kinds: Tensor  # uint8 [groups]: INT8, INT4 or NONE
    types: Tensor  # int16 [groups]: index into type_names
    type_names: tuple[str, ...]  # GGUF block type names, e.g. ("Q4_1", "Q8_0")


def _f16(raw: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(-1))


def block_grid(type_name: str, data: np.ndarray) -> tuple[Tensor, Tensor] | None:
    """Per-32-value (scale, min) float32 of a tensor's blocks (rows of bytes), or None for a type
    without a core layout."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, data.shape[-1])
    if type_name == "Q8_0":  # 34 bytes: f16 d, 32 x int8
        d = _f16(blocks.reshape(-1, 34)[:, :2])
        return d, torch.zeros_like(d)
    if type_name == "Q4_0":  # 18 bytes: f16 d, 16 bytes of nibbles; value = d * (q - 8)
        d = _f16(blocks.reshape(-1, 18)[:, :2])
        return d, -8 * d
    if type_name == "Q4_1":  # 20 bytes: f16 d, f16 m, 16 bytes of nibbles; value = d * q + m
        rows = blocks.reshape(-1, 20)
        return _f16(rows[:, :2]), _f16(rows[:, 2:4])
    if type_name == "Q4_K":  # 144 bytes per 256 values: f16 d, f16 dmin, 12 bytes of 6-bit sc/m, nibbles
        rows = blocks.reshape(-1, 144)
        d, dmin = _f16(rows[:, :2]), _f16(rows[:, 2:4])
        sc, m = Q4_K.get_scale_min(rows[:, 4:16].copy())
        sc_t, m_t = torch.from_numpy(sc.astype(np.float32)), torch.from_numpy(m.astype(np.float32))
        return (d[:, None] * sc_t).reshape(-1), (-(dmin[:, None] * m_t)).reshape(-1)
    return None


def read_grids(path: Path, fixup: Any, rename_to_hf: Any, hf_config: dict[str, Any]) -> SourceGrids:
    """The grids of every quantized tensor of the GGUF at `path`. `rename_to_hf(gguf name)`: its
    Hugging Face name (None: not a weight); `fixup(hf name, tensor, hf config)`: the family's
    GGUF tensor fixup, applied to the id maps as to the values."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    ids: dict[str, Tensor] = {}
    scales: list[Tensor] = []
    mins: list[Tensor] = []
    kinds: list[Tensor] = []
    types: list[Tensor] = []
    type_names: list[str] = []
    offset = 0
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        hf_name = rename_to_hf(tensor.name)
        if hf_name is None or type_name in ("F32", "F16", "BF16"):
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        count = int(np.prod(shape))
        if shape[-1] % GROUP:
            continue
        groups = count // GROUP
        grid = block_grid(type_name, tensor.data)
        if grid is None:
            scale, minimum = torch.full((groups,), float("nan")), torch.zeros(groups)
            kind = NONE
        else:
            scale, minimum = grid
            kind = KEPT[type_name]
        if type_name not in type_names:
            type_names.append(type_name)
        scales.append(scale)
        mins.append(minimum)
        kinds.append(torch.full((groups,), kind, dtype=torch.uint8))
        types.append(torch.full((groups,), type_names.index(type_name), dtype=torch.int16))
        group_ids = torch.arange(offset, offset + groups, dtype=torch.int32).repeat_interleave(GROUP).reshape(shape)
        ids[hf_name] = fixup(hf_name, group_ids, hf_config)
        offset += groups
    empty = torch.zeros(0)
    return SourceGrids(
        ids=ids,
        scales=torch.cat(scales) if scales else empty,
        mins=torch.cat(mins) if mins else empty,
        kinds=torch.cat(kinds) if kinds else empty.to(torch.uint8),
        types=torch.cat(types) if types else empty.to(torch.int16),
        type_names=tuple(type_names),
    )


__all__ = ["GROUP", "INT4", "INT8", "KEPT", "NONE", "SourceGrids", "block_grid", "read_grids"]
