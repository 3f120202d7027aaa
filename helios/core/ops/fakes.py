"""Fake kernels several flare:: ops share: tracing needs only their result's shape and dtype."""

from __future__ import annotations

import torch
from torch import Tensor


def like_first(first: Tensor, *_: object) -> Tensor:
    """The result of an op shaped and typed as its first argument (attention: its queries)."""
    return torch.empty_like(first)


def fp32_like_first(first: Tensor, *_: object) -> Tensor:
    """The result of an op shaped as its first argument, in fp32."""
    return first.new_empty(first.shape, dtype=torch.float32)
