"""What the reference kernels of the attention-like flare:: ops share.

Reading a sequence's history through its block table, the step's sequences that have both
queries and history, the causal (optionally windowed) visibility mask, and attention with
optional logit soft-capping. Plain torch; helios' faster kernels use the same masks and
attention so that both round alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class SequenceRows(NamedTuple):
    """One sequence of a step that has queries and history."""

    seq: int  # its row of block_tables / seq_lens
    start: int  # its query rows [start, end) of the step
    end: int
    kv_len: int  # history tokens (this step's included)


def sequence_rows(query_start_loc: Tensor, seq_lens: Tensor) -> list[SequenceRows]:
    """The sequences with at least one query and one history token, in order."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    return [
        SequenceRows(i, starts[i], starts[i + 1], kv_len)
        for i, kv_len in enumerate(lens)
        if starts[i + 1] > starts[i] and kv_len > 0
    ]


def history(cache: Tensor, block_table: Tensor, kv_len: int) -> Tensor:
    """One sequence's first kv_len cache rows [kv_len, heads, dim] through its block table.

    cache: [num_pages, page_tokens, heads, dim]; block_table: [max_blocks] the sequence's pages in order.
    """
    page_tokens = cache.shape[1]
    pages = block_table[: (kv_len + page_tokens - 1) // page_tokens].long()
    return cache[pages].reshape(-1, cache.shape[2], cache.shape[3])[:kv_len]


def visible_keys(key_positions: Tensor, query_positions: Tensor, window: int) -> Tensor:
    """[Tq, Tk] bool: key j is visible to the query at p iff j <= p and, with a window, j > p - window."""
    keys, queries = key_positions[None, :], query_positions[:, None]
    visible = keys <= queries
    return visible & (keys > queries - window) if window > 0 else visible


def attend(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    visible: Tensor | None,
    scale: float,
    softcap: float,
    causal: bool = False,
) -> Tensor:
    """Attention over [..., H, Tq, D] queries and [..., KVH, Tk, D] keys/values (GQA when H > KVH).

    SDPA has no soft-capping, so capped scores are computed explicitly (in fp32: tanh of
    16-bit scores would lose the small differences softmax then amplifies).
    """
    gqa = query.shape[-3] != keys.shape[-3]
    if softcap <= 0.0:
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if visible is None:  # plainly causal: keys and queries end at the same position
        tq, tk = query.shape[-2], keys.shape[-2]
        visible = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
    group = query.shape[-3] // keys.shape[-3]
    keys = keys.repeat_interleave(group, dim=-3).float()
    values = values.repeat_interleave(group, dim=-3).float()
    scores = (query.float() @ keys.transpose(-1, -2)) * scale
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~visible, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(query.dtype)
