"""helios' CPU kernels for the DeepSeek Sparse Attention ops (helios.core.ops.sparse).

Same arithmetic and selection rule as the reference kernels, laid out for speed: decode
rows (one query token per sequence) are scored in one batched matmul over their gathered,
padded page tables, and attend by gathering only their k selected latent rows, so a decode
token's attention reads k keys however long the sequence; prefill chunks score in blocks
of queries (bounded memory) and attend over their history under the selection's mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import attend, history, visible_keys
from helios.core.ops.sparse import index_scores, select_topk, selected_keys

# Prefill scores are built this many fp32 elements (queries x heads x keys) at a time.
_SCORE_BLOCK = 1 << 24


def _decode_rows(query_start_loc: Tensor) -> tuple[list[int], list[int]]:
    """(sequences with exactly one query this step, the others)."""
    starts = query_start_loc.tolist()
    decode = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
    chosen = set(decode)
    return decode, [i for i in range(len(starts) - 1) if i not in chosen and starts[i + 1] > starts[i]]


def indexer_topk_cpu(q, head_weights, k_cache, block_tables, seq_lens, query_start_loc, positions, scale, topk):
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    page_tokens, dim = k_cache.shape[1], k_cache.shape[-1]
    decode, prefill = _decode_rows(query_start_loc)
    starts = query_start_loc.tolist()
    if decode:
        picked = torch.tensor(decode)
        rows = query_start_loc[picked].long()
        lens = seq_lens[picked].long()
        blocks = int((lens.max() + page_tokens - 1) // page_tokens)
        pages = block_tables[picked, :blocks].long().clamp(min=0)  # [Bd, blocks]
        keys = k_cache.index_select(0, pages.reshape(-1)).view(len(decode), blocks * page_tokens, dim)
        scores = index_scores(q[rows][:, None], head_weights[rows][:, None], keys, scale)[:, 0]
        key_pos = torch.arange(blocks * page_tokens)[None, :]
        visible = (key_pos < lens[:, None]) & (key_pos <= positions[rows][:, None])
        out[rows] = select_topk(scores, visible, topk)
    for i in prefill:
        start, end, kv_len = starts[i], starts[i + 1], int(seq_lens[i])
        keys = history(k_cache, block_tables[i], kv_len)[:, 0]  # [S, D]
        step = max(1, _SCORE_BLOCK // max(1, q.shape[1] * kv_len))
        for a in range(start, end, step):
            b = min(end, a + step)
            scores = index_scores(q[a:b], head_weights[a:b], keys, scale)
            visible = visible_keys(torch.arange(kv_len), positions[a:b], 0)
            out[a:b] = select_topk(scores, visible, topk)
    return out


def sparse_paged_attention_cpu(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, topk_indices, scale
):
    out = torch.zeros_like(q)
    page_tokens, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    same = k_cache.data_ptr() == v_cache.data_ptr() and k_cache.shape == v_cache.shape  # MLA: one latent tensor
    decode, prefill = _decode_rows(query_start_loc)
    starts = query_start_loc.tolist()
    if decode:
        rows = query_start_loc[torch.tensor(decode)].long()
        index = topk_indices[rows].sort(dim=-1).values  # [Bd, k]; sorted so a repeated position shows
        valid = (index >= 0) & (index <= positions[rows][:, None])
        valid[:, 1:] &= index[:, 1:] != index[:, :-1]  # a key picked twice still counts once (as the mask does)
        at = index.clamp(min=0)
        tables = block_tables[torch.tensor(decode)].long()
        block = (at // page_tokens).clamp(max=tables.shape[1] - 1)  # an invalid pick still reads a valid page
        slots = tables.gather(1, block) * page_tokens + at % page_tokens  # [Bd, k]
        keys = k_cache.view(-1, kv_heads, dim).index_select(0, slots.reshape(-1))
        keys = keys.view(len(decode), -1, kv_heads, dim).transpose(1, 2).to(q.dtype)  # [Bd, KVH, k, D]
        if same:
            values = keys
        else:
            values = v_cache.view(-1, kv_heads, v_cache.shape[-1]).index_select(0, slots.reshape(-1))
            values = values.view(len(decode), -1, kv_heads, v_cache.shape[-1]).transpose(1, 2).to(q.dtype)
        attn = attend(q[rows][:, :, None, :], keys, values, valid[:, None, None, :], scale, 0.0)[:, :, 0]
        out[rows] = torch.where(valid.any(-1)[:, None, None], attn, 0.0)
    for i in prefill:
        start, end, kv_len = starts[i], starts[i + 1], int(seq_lens[i])
        keys = history(k_cache, block_tables[i], kv_len).transpose(0, 1).to(q.dtype)  # [KVH, S, D]
        values = keys if same else history(v_cache, block_tables[i], kv_len).transpose(0, 1).to(q.dtype)
        chosen = selected_keys(topk_indices[start:end], kv_len)
        chosen &= visible_keys(torch.arange(kv_len), positions[start:end], 0)
        # 4-D with a batch of one: the CPU flash kernel (3-D inputs fall back to the math path).
        attn = attend(q[start:end].transpose(0, 1)[None], keys[None], values[None], chosen, scale, 0.0)[0]
        out[start:end] = torch.where(chosen.any(-1)[None, :, None], attn, 0.0).transpose(0, 1)
    return out


def register(library: torch.library.Library) -> None:
    """Install these kernels into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("indexer_topk", indexer_topk_cpu, "CPU")
    library.impl("sparse_paged_attention", sparse_paged_attention_cpu, "CPU")
