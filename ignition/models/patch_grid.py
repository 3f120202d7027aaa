"""Patch-grid helpers shared by the vision towers that merge m x m patches into one token
(MiniMax M3, Kimi K2.5, GLM-5.3, Muse Spark): patches arrive in merge-block order."""

from __future__ import annotations

import torch
from torch import Tensor


def block_order(rows: int, cols: int, m: int) -> Tensor:
    """(x, y) positions [rows * cols, 2] of a rows x cols patch grid in merge-block order."""
    gy, gx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    shape = (rows // m, m, cols // m, m)
    ys, xs = (g.reshape(shape).transpose(1, 2).reshape(-1) for g in (gy, gx))
    return torch.stack([xs, ys], dim=-1)
