"""helios' CPU kernel for flare::paged_attention_until (helios.core.ops.bidirectional).

A step whose every query ends at its own position (decode steps, chunks without image tokens)
is plain paged attention (the fast kernels, checked once per step); one with image tokens
attends under the explicit mask of the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.bidirectional import reference_paged_attention_until
from helios.engine.kernels.memo import StepMemo

_plain_until: StepMemo[bool] = StepMemo()


def paged_attention_until_cpu(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, until, scale, window=0, softcap=0.0
) -> Tensor:
    """flare::paged_attention_until (arguments as its schema: helios.core.ops.bidirectional)."""
    plain = _plain_until.get((positions, until), lambda: bool(torch.equal(positions, until)))
    if plain:
        return torch.ops.flare.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window, softcap
        )
    return reference_paged_attention_until(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, until, scale, window, softcap
    )


def register(library: torch.library.Library) -> None:
    """Install this kernel into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("paged_attention_until", paged_attention_until_cpu, "CPU")
