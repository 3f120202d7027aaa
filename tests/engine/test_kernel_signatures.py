"""Every CPU kernel helios installs takes its flare:: op's arguments: the same names, in the same
order, with the same defaults. The kernels state no types of their own: the op's schema does
(helios.core.ops), and the dispatcher hands a kernel the op's arguments as that schema lists them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support import KernelRecorder, assert_takes_op_arguments

import helios.core.ops  # noqa: F401  (defines the flare:: ops)
from helios.core.ops.catalog import OP_NAMES
from helios.engine.kernels import attention, registry


def _installed() -> dict[str, Callable]:
    recording = KernelRecorder("CPU")
    for family in registry.FAMILIES:
        family.register(recording)
    # where the native library has loaded it serves these two itself, falling back to these kernels
    return recording.kernels | {"paged_attention": attention.paged_attention_cpu, "write_kv": attention.write_kv_cpu}


KERNELS = _installed()


def test_every_op_has_a_cpu_kernel() -> None:
    # flare::kpool_topk keeps its reference kernel (vectorized per sequence already); the collectives
    # (all_reduce, all_gather) keep theirs on every device: they call torch.distributed
    assert sorted(KERNELS) == sorted(set(OP_NAMES) - {"kpool_topk", "all_reduce", "all_gather"})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_kernel_takes_the_ops_arguments(name: str) -> None:
    assert_takes_op_arguments(name, KERNELS[name])
