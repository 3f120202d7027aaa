"""The `flare::` custom ops that exported step programs call: importing this package defines them all.

One module per op family (schemas with plain-torch reference kernels and fake kernels); the
pieces they share live in `attention` (paged history, masks, capped attention) and the op set a
manifest records in `catalog`. Each module imports what it uses directly, so no order matters.
"""

from helios.core.ops import (  # noqa: F401  (each module defines its family's ops)
    base,
    bidirectional,
    block_sparse,
    deepseek_v4,
    gated_delta,
    glm5_next,
    mamba,
    moe,
    recurrent,
    sinks,
    sparse,
)
