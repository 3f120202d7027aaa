"""Load-time simplifications of a program's graph for the CPU engine.

Each decode step runs the whole graph node by node from Python, so every node costs a few
microseconds of dispatch whatever its size. These rewrites keep the computation and drop
that overhead where it buys nothing:

* metadata assertions the exporter left in (they check inputs the executor builds itself);
* dtype conversions to the dtype the value already has (a float32 core's `.float()`);
* the flare:: ops, called straight into helios' CPU kernels instead of through the
  custom-op dispatcher and its Python wrappers (aliasing checks, version bumps).
"""

from __future__ import annotations

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


def simplify(program: Program) -> int:
    """Rewrite the program's graph in place for the CPU kernels; returns the nodes removed."""
    graph = program.module.graph
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
            removed += 1
        elif _same_dtype_conversion(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
        elif node.target in _DIRECT and not (native.loaded() and node.target in _NATIVE):
            node.target = _DIRECT[node.target]
    graph.lint()
    program.module.recompile()
    return removed


def upcast(program: Program) -> int:
    """Drop the program's conversions to 16-bit dtypes, for weights and KV upcast to fp32 at
    load on a host without native 16-bit matmuls; returns the conversions removed."""
    graph = program.module.graph
    removed = 0
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten.to.dtype
            and len(node.args) == 2
            and not node.kwargs
            and node.args[1] in (torch.bfloat16, torch.float16)
        ):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
    graph.lint()
    program.module.recompile()
    return removed
