"""Load-time rewrites of a program's graph: device placement on every device, simplifications on the CPU.

`place` makes a program run where the engine runs. torch.export records the export device in the
graph: every `.to(dtype)` leaves an `aten._assert_tensor_metadata(..., device=cpu)` check, and a
factory traced from model code (`arange(..., device=positions.device)` in cores exported before
the families took the device from their inputs) carries `device=cpu`. On any other device the
first would fail and the second would put a CPU tensor into a device step, so at load the checks
are dropped (the executor builds every input itself) and every device argument left names the
engine's device. Done once per program, for every device (cpu, cuda, meta): old cores keep running.

On the CPU, each decode step runs the whole graph node by node from Python, so every node costs a few
microseconds of dispatch whatever its size. These rewrites keep the computation and drop
that overhead where it buys nothing:

* metadata assertions (as `place` drops them, for callers that only simplify);
* dtype conversions to the dtype the value already has (a float32 core's `.float()`);
* the flare:: ops, called straight into helios' CPU kernels instead of through the
  custom-op dispatcher and its Python wrappers (aliasing checks, version bumps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from helios.core.program import Program
from helios.engine import native
from helios.engine.kernels import attention, block_sparse, gated_delta, glm5_next, mamba, moe, recurrent

_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}
_DIRECT = {
    torch.ops.flare.paged_attention.default: attention.paged_attention_cpu,
    torch.ops.flare.write_kv.default: attention.write_kv_cpu,
    torch.ops.flare.routed_experts.default: moe.routed_experts_cpu,
    torch.ops.flare.block_select.default: block_sparse.block_select_cpu,
    torch.ops.flare.block_sparse_attention.default: block_sparse.block_sparse_attention_cpu,
    torch.ops.flare.causal_conv1d.default: recurrent.causal_conv1d_cpu,
    torch.ops.flare.mamba2_scan.default: mamba.mamba2_scan_cpu,
    torch.ops.flare.gated_delta_rule.default: gated_delta.gated_delta_rule_cpu,
    torch.ops.flare.kda.default: glm5_next.kda_cpu,
}
# Served by the native library's own CPU kernels where it loads (kernels.registry): the op call
# costs less than the Python kernel's step bookkeeping.
_NATIVE = {torch.ops.flare.paged_attention.default, torch.ops.flare.write_kv.default}


def _same_dtype_conversion(node: fx.Node) -> bool:
    if node.target is not torch.ops.aten.to.dtype or len(node.args) != 2 or node.kwargs:
        return False
    source, dtype = node.args
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == dtype


def _rewrite(program: Program, rewrite: Callable[[fx.Node], bool]) -> int:
    """rewrite(node) on every call of the program's graph (True where it counts: a node removed or
    re-targeted), then the module recompiled; returns the count."""
    graph = program.module.graph
    changed = sum(rewrite(node) for node in list(graph.nodes) if node.op == "call_function")
    graph.lint()
    program.module.recompile()
    return changed


def _dropped(node: fx.Node) -> bool:
    """Erase an exporter's metadata assertion (it checks inputs the executor builds itself)."""
    if node.target in _ASSERTS and not node.users:
        node.graph.erase_node(node)
        return True
    return False


def _bypassed(node: fx.Node) -> bool:
    """Replace a conversion by its input (the callers decide which conversions are no-ops)."""
    node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
    node.graph.erase_node(node)
    return True


def place(program: Program, device: str) -> int:
    """Make the program run on `device` (the module docstring): drop the exporter's metadata
    assertions, point every device argument left in the graph at `device`, and move its tensor
    constants there (if it has any). Returns the nodes removed or re-targeted."""
    target = torch.device(device)
    retarget = lambda value: target if isinstance(value, torch.device) else value

    def rewrite(node: fx.Node) -> bool:
        if _dropped(node):
            return True
        if not (_names_device(node.args) or _names_device(node.kwargs)):
            return False
        node.args = fx.node.map_aggregate(node.args, retarget)  # type: ignore[assignment]
        node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)  # type: ignore[assignment]
        return True

    changed = _rewrite(program, rewrite)
    program.module.to(target)
    return changed


def _names_device(value: object) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, (tuple, list)):
        return any(_names_device(v) for v in value)
    if isinstance(value, dict):
        return any(_names_device(v) for v in value.values())
    return False


def simplify(program: Program) -> int:
    """Rewrite the program's graph in place for the CPU kernels; returns the nodes removed. The
    metadata assertions go too (as `place` drops them), for callers that only simplify."""

    def rewrite(node: fx.Node) -> bool:
        if _dropped(node):
            return True
        if _same_dtype_conversion(node):
            return _bypassed(node)
        if node.target in _DIRECT and not (native.loaded() and node.target in _NATIVE):
            node.target = _DIRECT[node.target]
        return False

    return _rewrite(program, rewrite)


def upcast(program: Program) -> int:
    """Drop the program's conversions to 16-bit dtypes, for weights and KV upcast to fp32 at
    load on a host without native 16-bit matmuls; returns the conversions removed."""
    return _rewrite(
        program,
        lambda node: (
            node.target is torch.ops.aten.to.dtype
            and len(node.args) == 2
            and not node.kwargs
            and node.args[1] in (torch.bfloat16, torch.float16)
            and _bypassed(node)
        ),
    )
