"""Which device helios serves on, and how large a CUDA KV pool fits beside the weights.

`[server] device` is "auto", "cpu", "cuda" or "cuda:N" (helios.config checks the spelling);
resolve() turns it into the torch device string the engine runs on; prepare() readies the flare::
ops for it (on CUDA, helios' Triton kernels). kv_pages_for() is the pure sizing rule for a CUDA
pool sized from free device memory (no kv_pages / kv_memory_mb); graph_reserve() says how much of
it the captured graphs keep: what capturing them took on this host before (measured with
torch.cuda.memory_reserved around each bucket's capture, remembered per core, device and torch),
the estimate only where this core's graphs were never captured here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from helios.core import hostcache

DEVICE_SETTING = re.compile(r"auto|cpu|cuda(:\d+)?")
# Device memory the captured CUDA graphs of one decode bucket are expected to hold (their
# private pool: activations of the bucket's step) before they were ever captured on this host:
# a first start's estimate. Later starts set aside what capture measured (graph_reserve).
GRAPH_RESERVE_PER_BUCKET = 32 << 20
GRAPH_MEMORY_CACHE = "graph-memory"  # hostcache name: measured bytes per decode bucket
GRAPH_HEADROOM = 1.1  # measured graph memory is set aside with this margin (allocator rounding between starts)


class DeviceError(ValueError):
    """The requested device cannot be used here; the message says what to do."""


def resolve(
    setting: str, cuda_available: Callable[[], bool] | None = None, device_count: Callable[[], int] | None = None
) -> str:
    """ "cpu", "cuda" or "cuda:N" for a `[server] device` setting; DeviceError where CUDA is asked
    for and absent (or the index is past the host's devices). The probes default to torch.cuda's."""
    if not DEVICE_SETTING.fullmatch(setting):
        raise DeviceError(f'[server] device must be "auto", "cpu", "cuda" or "cuda:N", got {setting!r}')
    if setting == "cpu":
        return "cpu"
    import torch

    available = (cuda_available or torch.cuda.is_available)()
    if setting == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise DeviceError(
            f'[server] device = "{setting}" but this host has no usable CUDA device (torch '
            f"{torch.__version__}, built with CUDA {torch.version.cuda}): install a CUDA build of torch "
            'on a host with an NVIDIA GPU and driver, or set device = "cpu" (or "auto")'
        )
    if ":" in setting:
        index, count = int(setting.split(":")[1]), (device_count or torch.cuda.device_count)()
        if index >= count:
            raise DeviceError(
                f'[server] device = "{setting}" but this host has {count} CUDA device(s) '
                f"(cuda:0..cuda:{count - 1}): pick one of them"
            )
    return setting


def is_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def prepare(device: str) -> None:
    """Ready the dispatcher for steps on `device`, before any program runs there: on CUDA, helios'
    Triton kernels for every flare:: op go into its CUDA slot (helios.engine.cuda.registry; once
    per process). DeviceError where triton is not installed; nothing to do on other devices."""
    if not is_cuda(device):
        return
    from helios.engine.cuda import registry

    try:
        registry.register()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "triton":
            raise
        import torch

        raise DeviceError(
            f'[server] device = "{device}" needs triton, which helios\' CUDA kernels for the flare:: ops are '
            f"written in, and it is not installed here ({exc}; torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}): install the triton release this torch was built with (pip install triton), "
            'or set device = "cpu"'
        ) from exc


def kv_pages_for(free_bytes: int, fraction: float, page_bytes: int, graph_reserve_bytes: int) -> int:
    """KV pages a CUDA pool gets from `free_bytes` of free device memory (after the weights):
    `fraction` of it, less what the captured graphs keep, in whole pages. DeviceError when not
    even one page fits (the message says how much was free and what to change)."""
    if not 0 < fraction <= 1:
        raise DeviceError(f"[server] kv_memory_fraction must be above 0 and at most 1, got {fraction!r}")
    if page_bytes < 1 or free_bytes < 0 or graph_reserve_bytes < 0:
        raise ValueError("page_bytes must be positive, free and reserve bytes non-negative")
    usable = int(free_bytes * fraction) - graph_reserve_bytes
    if usable < page_bytes:
        raise DeviceError(
            f"the KV pool does not fit on the device: {free_bytes >> 20} MiB free after the weights, "
            f"{fraction:g} of it less {graph_reserve_bytes >> 20} MiB for CUDA graphs leaves less than "
            f"one {page_bytes} byte page; free device memory, raise kv_memory_fraction, set "
            "cuda_graphs = false, or give kv_pages / kv_memory_mb"
        )
    return usable // page_bytes


def graph_reserve(buckets: tuple[int, ...], measured: Mapping[int, int] | None) -> int:
    """Bytes the KV pool leaves for the decode buckets' captured graphs: each bucket's measured
    capture bytes (GRAPH_HEADROOM over them), the per-bucket estimate for a bucket never measured."""
    known = measured or {}
    return sum(int(known[b] * GRAPH_HEADROOM) if b in known else GRAPH_RESERVE_PER_BUCKET for b in sorted(set(buckets)))


def graph_memory_key(core_digest: str, device_name: str, buckets: tuple[int, ...], torch_version: str) -> str:
    """The hostcache key of a core's measured graph memory: it changes with the core, the device
    model, the buckets and torch (its kernels and allocator)."""
    return f"{core_digest}|{device_name}|{sorted(set(buckets))}|{torch_version}"


def remembered_graph_bytes(key: str) -> dict[int, int] | None:
    """Measured capture bytes per bucket from an earlier start on this host, or None."""
    value = hostcache.get(GRAPH_MEMORY_CACHE, key)
    if not isinstance(value, dict):
        return None
    return {int(bucket): int(size) for bucket, size in value.items()}


def remember_graph_bytes(key: str, measured: Mapping[int, int]) -> None:
    hostcache.put(GRAPH_MEMORY_CACHE, key, {str(bucket): int(size) for bucket, size in measured.items()})


def device_name(device: str) -> str:  # pragma: no cover - needs a GPU
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def free_device_bytes(device: str) -> int:  # pragma: no cover - needs a GPU
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
