"""The base flare:: ops every program calls: flare::write_kv and flare::paged_attention.

Programs never trace paged attention into gathers: they call these ops, whose schemas
are part of the core format (helios.core.ops.catalog). This module registers the schemas
with reference CPU kernels (plain torch, used by ignition for export checks) and fake
kernels for tracing. helios' engine may register faster device kernels for the same ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import attend, history, sequence_rows, visible_keys
from helios.core.ops.fakes import like_first


@torch.library.custom_op("flare::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new keys/values into their cache slots.

    k_cache, v_cache: [num_pages, page_tokens, num_kv_heads, head_dim]
    k, v:             [num_tokens, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens] int64, page * page_tokens + offset; negative = padding, skipped

    Returning nothing, its fake kernel is the trivial one torch.library generates.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    flat_v = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    flat_k.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v[keep].to(v_cache.dtype))


@torch.library.custom_op("flare::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Causal attention of a flat batch of query tokens over paged KV history.

    q:               [num_tokens, num_heads, head_dim]
    k_cache/v_cache: [num_pages, page_tokens, num_kv_heads, head_dim] (already holding this step's keys)
    block_tables:    [num_seqs, max_blocks] int32, page ids of each sequence in order
    seq_lens:        [num_seqs] int32, KV length of each sequence after this step
    query_start_loc: [num_seqs + 1] int32, offsets of each sequence's queries in q
    positions:       [num_tokens] int64, absolute position of each query (key j is visible iff j <= position)
    window:          sliding window: key j is visible iff position - window < j <= position; 0 = global
    softcap:         logit soft-capping, scores = softcap * tanh(scores / softcap); 0 = off
    returns          [num_tokens, num_heads, head_dim]

    The trailing options have defaults so programs exported before they existed still load.
    """
    out = torch.zeros_like(q)
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        query = q[start:end].transpose(0, 1)  # [H, Tq, D]
        keys = history(k_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)  # [KVH, Tk, D]
        values = history(v_cache, block_tables[seq], kv_len).transpose(0, 1).to(q.dtype)
        visible = visible_keys(torch.arange(kv_len, device=q.device), positions[start:end], window)
        attn = attend(query, keys, values, visible, scale, softcap)
        out[start:end] = attn.transpose(0, 1)
    return out


paged_attention.register_fake(like_first)


# The plain-torch bodies of the two ops, callable without the dispatcher: where helios' native
# library is loaded, the ops' CPU slot is served from C++ (helios/engine/native), and tests
# compare every kernel with these.
reference_paged_attention = paged_attention._init_fn
reference_write_kv = write_kv._init_fn
