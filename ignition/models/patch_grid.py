"""Patch-grid helpers shared by the vision towers: row-major grids (Step 3.7, Gemma 4), and the
merge-block order the towers that merge m x m patches into one token (MiniMax M3, Kimi K2.5,
GLM-5.3, Muse Spark) take their patches in."""

from __future__ import annotations

import torch
from torch import Tensor


def raster_order(rows: int, cols: int) -> Tensor:
    """(x, y) positions [rows * cols, 2] of a rows x cols patch grid, row-major."""
    gy, gx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([gx.reshape(-1), gy.reshape(-1)], dim=-1)


def block_order(rows: int, cols: int, m: int) -> Tensor:
    """(x, y) positions [rows * cols, 2] of a rows x cols patch grid in merge-block order."""
    gy, gx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    shape = (rows // m, m, cols // m, m)
    ys, xs = (g.reshape(shape).transpose(1, 2).reshape(-1) for g in (gy, gx))
    return torch.stack([xs, ys], dim=-1)


def still_clip_example(merge_size: int, patch_size: int, temporal_patch_size: int) -> tuple[Tensor, Tensor]:
    """A tower's tracing example: a (2m) x (3m) patch grid (2 x 3 tokens), rows unlike columns so neither
    specializes, in merge-block order; each patch's frames repeat one still image, as the processors make
    them -> (pixels [X, 3 * frames * patch^2], positions [X, 2])."""
    m = merge_size
    rows, cols = 2 * m, 3 * m
    generator = torch.Generator().manual_seed(0)
    still = torch.randn(rows * cols, 3, 1, patch_size**2, generator=generator)
    pixels = still.expand(-1, -1, temporal_patch_size, -1).reshape(rows * cols, 3 * temporal_patch_size * patch_size**2)
    return pixels.contiguous(), block_order(rows, cols, m)
