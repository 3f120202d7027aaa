"""The `flare::` custom ops that exported step programs call: importing this package defines them all.

One module per op family (schemas with plain-torch reference kernels and fake kernels), as
`catalog.OPS` maps them; the pieces they share live in `attention` (paged history, masks,
capped attention). Each module imports what it uses directly, so no order matters.
"""

from importlib import import_module

from helios.core.ops.catalog import OPS

for _family in dict.fromkeys(OPS.values()):
    import_module(f"{__name__}.{_family}")
