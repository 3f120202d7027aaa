"""CPU weight prepacking: the programs' linear layers run on oneDNN with packed weights.

ATen sends fp32 `linear` to MKL, whose small-batch GEMM and GEMV paths are several times
slower than oneDNN's on packed weights on many CPUs (measured here: 3-4x at 1-64 rows).
At load, every `aten.linear` whose weight is a program input is rewritten to a oneDNN
linear; weights used only by linears are replaced by their packed form (no second copy),
and a weight shared with other ops (a tied embedding) keeps its plain tensor while the
linear reads a packed copy held by the program module.

The core's programs and weights are unchanged on disk: this is a runtime rewrite, like
registering faster kernels for the flare:: ops.
"""

from __future__ import annotations

import torch
from torch import Tensor, fx

from helios.core.program import Program

_PACK_ROWS_HINT = 32  # oneDNN picks a blocking for this many rows; any row count runs


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` on a oneDNN-packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)


def _weight_inputs(program: Program, names: list[str]) -> dict[fx.Node, str]:
    """Placeholder node -> weights-dict key, for the program's leading weight inputs."""
    placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders[: len(names)], names, strict=True))


def prepack(programs: list[Program], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rewrite the programs' linears in place; returns the weights dict to call them with.

    All programs must take `weights` (same keys, same order) as their first input.
    """
    names = list(weights)
    linear = torch.ops.aten.linear.default
    packable = {name for name, w in weights.items() if w.dim() == 2 and w.dtype in (torch.float32, torch.bfloat16)}
    linear_only = set(packable)
    rewrites: list[tuple[Program, fx.Node, str]] = []
    for program in programs:
        for node, name in _weight_inputs(program, names).items():
            for user in node.users:
                is_weight_of_linear = user.target is linear and len(user.args) > 1 and user.args[1] is node
                if is_weight_of_linear and name in packable and node not in user.args[:1] + user.args[2:]:
                    rewrites.append((program, user, name))
                else:
                    linear_only.discard(name)
    if not rewrites:
        return weights
    packed = {name: pack(weights[name]) for name in {name for _, _, name in rewrites}}
    for program in {id(p): p for p, _, _ in rewrites}.values():
        module = program.module
        for _, node, name in (r for r in rewrites if r[0] is program):
            node.target = packed_linear
            if name not in linear_only:  # shared with other ops: the linear reads a copy
                attr = "_helios_packed_" + name.replace(".", "_")
                module.register_buffer(attr, packed[name], persistent=False)
                with module.graph.inserting_before(node):
                    node.args = (node.args[0], module.graph.get_attr(attr), *node.args[2:])
        module.graph.lint()
        module.recompile()
    # Weights no loaded program reads (a drafter's, e.g. MiMo's MTP layers) stay as they are.
    return {name: packed[name] if name in linear_only and name in packed else w for name, w in weights.items()}
