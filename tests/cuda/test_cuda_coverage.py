"""Every flare:: op a core's programs may call has a CUDA kernel (issue: the GPU path), except the
collectives, whose one implementation runs on any device through torch.distributed."""

from __future__ import annotations

from importlib import import_module

from helios.core.ops import catalog
from helios.engine.cuda import registry

DEVICE_NEUTRAL = {"all_reduce", "all_gather"}  # torch.distributed's own backends (gloo, NCCL)


class _Recorder:
    def __init__(self) -> None:
        self.names: list[str] = []

    def impl(self, name: str, fn: object, key: str) -> None:
        assert key == "CUDA"
        self.names.append(name)


def test_every_flare_op_has_a_cuda_kernel() -> None:
    library = _Recorder()
    for family in registry.FAMILIES:
        import_module(f"helios.engine.cuda.{family}").register(library)
    assert len(library.names) == len(set(library.names))  # no op installed twice
    assert set(library.names) == set(catalog.OP_NAMES) - DEVICE_NEUTRAL
