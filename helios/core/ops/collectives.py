"""The collective flare:: ops a tensor-parallel rank program calls where its shards meet:
flare::all_reduce (sum) and flare::all_gather (concatenation along a dim).

A program names its group ("tp") and how many ranks it was traced for; the kernels run them over
the torch.distributed process group that helios joined under that name (`bind`). With one rank
they are the identity, so a program traced for N ranks refuses to run alone only when N > 1 and no
group is bound. AOTInductor keeps custom ops as fallback calls, so a compiled rank program calls
the same kernels. The fake kernels give tracing the result shapes (all_gather: `ranks` times the
input's size along `dim`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

TENSOR_GROUP = "tp"  # the group name tensor- and expert-parallel programs use

# group name -> the torch.distributed process group helios joined for it
_GROUPS: dict[str, Any] = {}


class CollectiveError(RuntimeError):
    """A collective could not run: no group bound, or a group of another size."""


def bind(name: str, group: Any) -> None:
    """Make the collectives named `name` run over `group` (a torch.distributed ProcessGroup)."""
    _GROUPS[name] = group


def unbind(name: str) -> None:
    _GROUPS.pop(name, None)


def _group(name: str, ranks: int) -> Any:
    group = _GROUPS.get(name)
    if group is None:
        raise CollectiveError(
            f"this program was exported for {ranks} ranks (group {name!r}) and no such group is joined: "
            "serve it with `helios serve --tensor-parallel`"
        )
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size != ranks:
        raise CollectiveError(f"group {name!r} has {size} ranks, the program was exported for {ranks}")
    return group


@torch.library.custom_op("flare::all_reduce", mutates_args=())
def all_reduce(x: Tensor, ranks: int, group: str) -> Tensor:
    """The elementwise sum of x over the `ranks` ranks of `group` (every rank gets it).

    x:      any shape and float dtype, the same on every rank
    ranks:  the group's size the program was exported for; 1 = identity
    returns x's shape and dtype
    """
    out = x.contiguous().clone()
    if ranks == 1:
        return out
    import torch.distributed as dist

    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_group(group, ranks))
    return out


@all_reduce.register_fake
def _(x: Tensor, ranks: int, group: str) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("flare::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, ranks: int, group: str) -> Tensor:
    """Every rank's x concatenated along `dim` in rank order (every rank gets it).

    x:      the same shape on every rank
    returns x's shape with size(dim) * ranks along dim
    """
    if ranks == 1:
        return x.contiguous().clone()
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(ranks)]
    dist.all_gather(parts, x.contiguous(), group=_group(group, ranks))
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _(x: Tensor, dim: int, ranks: int, group: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * ranks
    return x.new_empty(shape)
