"""flare::paged_attention_until: paged attention where a query may also see keys after it.

Gemma 4's vision cores (`use_bidirectional_attention: "vision"`) let the tokens of one image
attend to each other both ways on sliding layers: transformers' mask there is AND(window,
OR(causal, same image)). For a query at p inside an image whose tokens are [s, e), that is keys
j with p - window < j <= e - 1; for any other query, p - window < j <= p. `until` carries that
last visible key per query (its position for every query outside an image), so the op is
flare::paged_attention with `positions` bounding the window and `until` the causal edge. Every
key up to `until` must be in the cache when the op runs: helios plans prefill chunks so that an
image is never split between two (its tokens' keys are all written before the layer attends).
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import attend, history, sequence_rows
from helios.core.ops.fakes import like_first


@torch.library.custom_op("flare::paged_attention_until", mutates_args=())
def paged_attention_until(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    until: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """As flare::paged_attention (same arguments and shapes), plus until [num_tokens] int64: key j is
    visible to query t iff positions[t] - window < j <= until[t] (window 0: j <= until[t])."""
    out = torch.zeros_like(q)
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        keys = history(k_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)
        values = history(v_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)
        visible = visible_until(torch.arange(kv_len, device=q.device), positions[start:end], until[start:end], window)
        out[start:end] = attend(q[start:end].transpose(0, 1), keys, values, visible, scale, softcap).transpose(0, 1)
    return out


def visible_until(key_positions: Tensor, query_positions: Tensor, until: Tensor, window: int) -> Tensor:
    """[Tq, Tk] bool: key j visible iff j <= until and, with a window, j > position - window."""
    keys = key_positions[None, :]
    visible = keys <= until[:, None]
    return visible & (keys > query_positions[:, None] - window) if window > 0 else visible


paged_attention_until.register_fake(like_first)


# The op's plain-torch body, callable without the dispatcher (helios' kernel falls back to it).
reference_paged_attention_until = paged_attention_until._init_fn
