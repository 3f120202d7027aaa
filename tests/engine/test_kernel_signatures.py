"""Every CPU kernel helios installs takes its flare:: op's arguments: the same names, in the same
order, with the same defaults. The kernels state no types of their own: the op's schema does
(helios.core.ops), and the dispatcher hands a kernel the op's arguments as that schema lists them."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch

import helios.core.ops  # noqa: F401  (defines the flare:: ops)
from helios.core.ops.catalog import OP_NAMES
from helios.engine.kernels import attention, registry


class _Recording:
    """Stands in for the flare IMPL library: records what each family installs."""

    def __init__(self) -> None:
        self.kernels: dict[str, Callable] = {}

    def impl(self, name: str, kernel: Callable, key: str) -> None:
        assert key == "CPU"
        self.kernels[name] = kernel


def _installed() -> dict[str, Callable]:
    recording = _Recording()
    for family in registry.FAMILIES:
        family.register(recording)
    # where the native library has loaded it serves these two itself, falling back to these kernels
    return recording.kernels | {"paged_attention": attention.paged_attention_cpu, "write_kv": attention.write_kv_cpu}


KERNELS = _installed()


def test_every_op_has_a_cpu_kernel() -> None:
    # flare::kpool_topk keeps its reference kernel (vectorized per sequence already)
    assert sorted(KERNELS) == sorted(set(OP_NAMES) - {"kpool_topk"})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_kernel_takes_the_ops_arguments(name: str) -> None:
    schema = getattr(torch.ops.flare, name).default._schema
    expected = [
        (a.name, a.default_value if a.has_default_value() else inspect.Parameter.empty) for a in schema.arguments
    ]
    parameters = inspect.signature(KERNELS[name]).parameters.values()
    assert [(p.name, p.default) for p in parameters] == expected
