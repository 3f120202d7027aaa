"""The `flare::` custom-op set that exported step programs call (core format v1).

Programs never trace paged attention into gathers: they call these ops, whose schemas
are part of the core format. This module registers the schemas with reference CPU
kernels (plain torch, used by ignition for export checks) and fake kernels for tracing.
helios' engine may register faster device kernels for the same ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

OPS_NAMESPACE = "flare"
OPS_VERSION = 1
OP_NAMES = ("write_kv", "paged_attention")


@torch.library.custom_op("flare::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new keys/values into their cache slots.

    k_cache, v_cache: [num_pages, page_tokens, num_kv_heads, head_dim]
    k, v:             [num_tokens, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens] int64, page * page_tokens + offset; negative = padding, skipped
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    flat_v = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    flat_k.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v[keep].to(v_cache.dtype))


@write_kv.register_fake
def _write_kv_fake(k_cache, v_cache, k, v, slot_mapping) -> None:
    return None


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
) -> Tensor:
    """Causal attention of a flat batch of query tokens over paged KV history.

    q:               [num_tokens, num_heads, head_dim]
    k_cache/v_cache: [num_pages, page_tokens, num_kv_heads, head_dim] (already holding this step's keys)
    block_tables:    [num_seqs, max_blocks] int32, page ids of each sequence in order
    seq_lens:        [num_seqs] int32, KV length of each sequence after this step
    query_start_loc: [num_seqs + 1] int32, offsets of each sequence's queries in q
    positions:       [num_tokens] int64, absolute position of each query (key j is visible iff j <= position)
    returns          [num_tokens, num_heads, head_dim]
    """
    out = torch.zeros_like(q)
    page_tokens = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, kv_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end <= start or kv_len <= 0:
            continue
        num_blocks = (kv_len + page_tokens - 1) // page_tokens
        pages = block_tables[i, :num_blocks].long()
        keys = k_cache[pages].reshape(-1, num_kv_heads, k_cache.shape[-1])[:kv_len]
        values = v_cache[pages].reshape(-1, num_kv_heads, v_cache.shape[-1])[:kv_len]
        query = q[start:end].transpose(0, 1)  # [H, Tq, D]
        keys = keys.transpose(0, 1).to(q.dtype)  # [KVH, Tk, D]
        values = values.transpose(0, 1).to(q.dtype)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= positions[start:end, None]
        attn = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[start:end] = attn.transpose(0, 1)
    return out


@paged_attention.register_fake
def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale):
    return torch.empty_like(q)


def describe() -> dict[str, object]:
    """The op-set record a core manifest stores."""
    return {"namespace": OPS_NAMESPACE, "version": OPS_VERSION, "ops": list(OP_NAMES)}
