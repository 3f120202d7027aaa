"""helios' own kernels for the flare:: ops (the core's reference kernels are correct but slow).

CPU: decode rows (one query token per sequence) of a step are attended in one batched
gather + matmul over the padded page tables; prefill chunks use SDPA per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops  # noqa: F401  (defines the ops before kernels are registered)

_registered = False


def _decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor, scale: float) -> Tensor:
    """q [B, H, D], one query per sequence at its last position; returns [B, H, D]."""
    batch, heads, dim = q.shape
    page_tokens, kv_heads = k_cache.shape[1], k_cache.shape[2]
    longest = int(lens.max())
    j = torch.arange(longest)
    slots = tables[:, j // page_tokens].long() * page_tokens + (j % page_tokens)  # [B, L]
    keys = k_cache.view(-1, kv_heads, dim)[slots]  # [B, L, KVH, D]
    values = v_cache.view(-1, kv_heads, dim)[slots]
    group = heads // kv_heads
    qg = q.view(batch, kv_heads, group, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys.to(q.dtype)) * scale
    scores.masked_fill_((j[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, values.to(q.dtype)).reshape(batch, heads, dim)


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale):
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode])
        picked = torch.tensor(decode)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[picked], seq_lens[picked].long(), scale)
    page_tokens, kv_heads = k_cache.shape[1], k_cache.shape[2]
    decode_set = set(decode)
    for i, kv_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if i in decode_set or end <= start:
            continue
        pages = block_tables[i, : -(-kv_len // page_tokens)].long()
        keys = k_cache[pages].reshape(-1, kv_heads, k_cache.shape[-1])[:kv_len].transpose(0, 1).to(q.dtype)
        values = v_cache[pages].reshape(-1, kv_heads, v_cache.shape[-1])[:kv_len].transpose(0, 1).to(q.dtype)
        query = q[start:end].transpose(0, 1)
        visible = torch.arange(kv_len)[None, :] <= positions[start:end, None]
        out[start:end] = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != kv_heads
        ).transpose(0, 1)
    return out


def write_kv_cpu(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Like the reference, without the boolean-mask copies when no slot is padding."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def register() -> None:
    """Install helios' CPU kernels (idempotent)."""
    global _registered
    if not _registered:
        torch.library.register_kernel("flare::paged_attention", "cpu", paged_attention_cpu)
        torch.library.register_kernel("flare::write_kv", "cpu", write_kv_cpu)
        _registered = True
