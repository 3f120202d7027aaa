"""The `flare::` custom-op set that exported step programs call (core format v1).

Programs never trace paged attention into gathers: they call these ops, whose schemas
are part of the core format. This module registers the schemas with reference CPU
kernels (plain torch, used by ignition for export checks) and fake kernels for tracing.
helios' engine may register faster device kernels for the same ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core import ops_block_sparse  # noqa: F401  (defines flare::block_select, flare::block_sparse_attention)
from helios.core import ops_deepseek_v4  # noqa: F401  (defines flare::dsv4_pool, dsv4_indexer_topk, dsv4_attention)
from helios.core import ops_mamba  # noqa: F401  (defines flare::mamba2_scan)
from helios.core import ops_gated_delta  # noqa: F401  (defines flare::gated_delta_rule)
from helios.core import ops_glm5_next  # noqa: F401  (defines flare::kda, flare::kpool_topk)
from helios.core import ops_moe  # noqa: F401  (defines flare::routed_experts)
from helios.core import ops_recurrent  # noqa: F401  (defines flare::causal_conv1d)
from helios.core import ops_sinks  # noqa: F401  (defines flare::sink_attention)
from helios.core import ops_sparse  # noqa: F401  (defines flare::indexer_topk, flare::sparse_paged_attention)

OPS_NAMESPACE = "flare"
OPS_VERSION = 1
# routed_experts: helios.core.ops_moe; block_select, block_sparse_attention: helios.core.ops_block_sparse;
# indexer_topk, sparse_paged_attention: helios.core.ops_sparse; dsv4_*: helios.core.ops_deepseek_v4;
# causal_conv1d: helios.core.ops_recurrent; mamba2_scan: helios.core.ops_mamba; gated_delta_rule:
# helios.core.ops_gated_delta; sink_attention: helios.core.ops_sinks; kda, kpool_topk: helios.core.ops_glm5_next
OP_NAMES = (
    "write_kv",
    "paged_attention",
    "routed_experts",
    "block_select",
    "block_sparse_attention",
    "indexer_topk",
    "sparse_paged_attention",
    "dsv4_pool",
    "dsv4_indexer_topk",
    "dsv4_attention",
    "causal_conv1d",
    "mamba2_scan",
    "gated_delta_rule",
    "sink_attention",
    "kda",
    "kpool_topk",
    "paged_attention_until",
)


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
    page_tokens = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
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
        visible = visible_keys(torch.arange(kv_len, device=q.device), positions[start:end], window)
        attn = attend(query, keys, values, visible, scale, softcap)
        out[start:end] = attn.transpose(0, 1)
    return out


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


@paged_attention.register_fake
def _paged_attention_fake(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0
):
    return torch.empty_like(q)


# The plain-torch bodies of the two ops, callable without the dispatcher: where helios' native
# library is loaded, the ops' CPU slot is served from C++ (helios/engine/native), and tests
# compare every kernel with these.
reference_paged_attention = paged_attention._init_fn
reference_write_kv = write_kv._init_fn


def describe() -> dict[str, object]:
    """The op-set record a core manifest stores."""
    return {"namespace": OPS_NAMESPACE, "version": OPS_VERSION, "ops": list(OP_NAMES)}


from helios.core import ops_bidirectional  # noqa: E402,F401  (defines flare::paged_attention_until; uses attend)
