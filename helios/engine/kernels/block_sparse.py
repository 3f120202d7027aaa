"""helios' CPU kernels for the block-sparse ops (helios.core.ops.block_sparse).

Decode rows (one query per sequence) are handled together: block_select scores all of them
in one padded page gather, and block_sparse_attention gathers only the selected blocks'
keys (topk_blocks * block_size per KV group, however long the history), one SDPA call with
each KV group's query heads as its query rows. Prefill chunks go sequence by sequence over
their whole history under a block mask. The decode layout is planned once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.block_sparse import block_visible, select_blocks
from helios.engine.kernels.memo import StepMemo


@dataclass(frozen=True, slots=True)
class _Plan:
    decode_rows: Tensor | None  # [Bd] query rows of one-token sequences
    decode_seqs: Tensor | None  # [Bd] their sequence index
    decode_pages: Tensor | None  # [Bd * blocks] pages covering every decode row's history, padded to `blocks`
    blocks: int  # pages gathered per decode row
    prefills: tuple[tuple[int, int, int, int], ...]  # (sequence, start, end, kv_len) of the other sequences
    identity: bool  # every row decodes, in order: outputs need no scatter


def _plan(block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, page_tokens: int) -> _Plan:
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [i for i, n in enumerate(lens) if starts[i + 1] - starts[i] == 1 and n > 0]
    rows = seqs = pages = None
    blocks = 0
    if decode:
        seqs = torch.tensor(decode)
        rows = torch.tensor([starts[i] for i in decode])
        blocks = -(-max(lens[i] for i in decode) // page_tokens)
        pages = block_tables[seqs, :blocks].reshape(-1).long()
    decoded = set(decode)
    prefills = tuple(
        (i, starts[i], starts[i + 1], n)
        for i, n in enumerate(lens)
        if i not in decoded and starts[i + 1] > starts[i] and n > 0
    )
    identity = decode == list(range(len(lens))) and starts[-1] == len(decode)
    return _Plan(rows, seqs, pages, blocks, prefills, identity)


_plans: StepMemo[_Plan] = StepMemo()


def _step_plan(block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, page_tokens: int) -> _Plan:
    return _plans.get(
        (block_tables, seq_lens, query_start_loc), lambda: _plan(block_tables, seq_lens, query_start_loc, page_tokens)
    )


def _history(cache: Tensor, block_tables: Tensor, seq: int, kv_len: int) -> Tensor:
    pages = block_tables[seq, : -(-kv_len // cache.shape[1])].long()
    return cache.index_select(0, pages).view(-1, cache.shape[-2], cache.shape[-1])[:kv_len]


def block_select_cpu(
    idx_q, idx_k_cache, block_tables, seq_lens, query_start_loc, positions, block_size, topk_blocks, local_blocks
):
    page_tokens, dim = idx_k_cache.shape[1], idx_k_cache.shape[-1]
    plan = _step_plan(block_tables, seq_lens, query_start_loc, page_tokens)
    decoded = None
    if plan.decode_rows is not None:
        count = len(plan.decode_rows)
        keys = idx_k_cache.index_select(0, plan.decode_pages).view(count, plan.blocks * page_tokens, dim)
        rows = slice(None) if plan.identity else plan.decode_rows
        decoded = select_blocks(
            idx_q[rows][:, None], keys, positions[rows][:, None], block_size, topk_blocks, local_blocks
        )[:, 0]
        if plan.identity:
            return decoded
    out = torch.full((*idx_q.shape[:2], topk_blocks), -1, dtype=torch.int64)
    if decoded is not None:
        out[plan.decode_rows] = decoded
    for seq, start, end, kv_len in plan.prefills:
        keys = _history(idx_k_cache, block_tables, seq, kv_len)[:, 0]
        out[start:end] = select_blocks(
            idx_q[start:end][None], keys[None], positions[start:end][None], block_size, topk_blocks, local_blocks
        )[0]
    return out


def _decode_attention(q, k_cache, v_cache, block_ids, block_tables, positions, scale, block_size, plan) -> Tensor:
    """Decode rows over their selected blocks only (one selection per KV group): [Bd, H, D]."""
    rows = plan.decode_rows
    count, heads, dim = len(rows), q.shape[1], q.shape[2]
    page_tokens, kv_heads = k_cache.shape[1], k_cache.shape[2]
    ids = block_ids[rows]  # [Bd, KVH, K]
    key_pos = (ids[..., None] * block_size + torch.arange(block_size)).flatten(-2)  # [Bd, KVH, K * bs]
    visible = (ids[..., None] >= 0).expand(*ids.shape, block_size).flatten(-2) & (
        key_pos <= positions[rows][:, None, None]
    )
    key_pos = key_pos.masked_fill(~visible, 0)
    tables = block_tables[plan.decode_seqs].long()  # [Bd, W]
    columns = (key_pos // page_tokens).clamp(max=tables.shape[1] - 1).view(count, -1)
    slots = tables.gather(1, columns).view_as(key_pos) * page_tokens + key_pos % page_tokens
    group = torch.arange(kv_heads)[None, :, None]
    keys = k_cache.view(-1, kv_heads, dim)[slots, group].to(q.dtype)  # [Bd, KVH, N, D]
    values = v_cache.view(-1, kv_heads, dim)[slots, group].to(q.dtype)
    query = q[rows].view(count, kv_heads, heads // kv_heads, dim)  # a group's heads as its query rows
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, :, None, :], scale=scale)
    return out.reshape(count, heads, dim)


def block_sparse_attention_cpu(
    q, k_cache, v_cache, block_ids, block_tables, seq_lens, query_start_loc, positions, scale, block_size
):
    heads, select_heads, kv_heads = q.shape[1], block_ids.shape[1], k_cache.shape[2]
    plan = _step_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    prefills = list(plan.prefills)
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        if select_heads == kv_heads:
            decoded = _decode_attention(
                q, k_cache, v_cache, block_ids, block_tables, positions, scale, block_size, plan
            )
            if plan.identity:
                return decoded
            out[plan.decode_rows] = decoded
        else:  # selections not aligned with KV groups: the general masked path below
            prefills += [
                (int(s), int(r), int(r) + 1, int(seq_lens[s])) for r, s in zip(plan.decode_rows, plan.decode_seqs)
            ]
    per = heads // select_heads
    for seq, start, end, kv_len in prefills:
        keys = _history(k_cache, block_tables, seq, kv_len).transpose(0, 1).to(q.dtype)  # [KVH, Tk, D]
        values = _history(v_cache, block_tables, seq, kv_len).transpose(0, 1).to(q.dtype)
        if kv_heads != select_heads:
            keys, values = (
                t.repeat_interleave(heads // kv_heads, dim=0).unflatten(0, (select_heads, per)) for t in (keys, values)
            )
        else:
            keys, values = (t[:, None].expand(-1, per, -1, -1) for t in (keys, values))
        visible = block_visible(block_ids[start:end], positions[start:end], kv_len, block_size).transpose(0, 1)
        query = q[start:end].transpose(0, 1).unflatten(0, (select_heads, per))  # [Hs, per, Tq, D]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, None], scale=scale)
        out[start:end] = attn.flatten(0, 1).transpose(0, 1)
    return out


def register(library: torch.library.Library) -> None:
    """Install these kernels into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("block_select", block_select_cpu, "CPU")
    library.impl("block_sparse_attention", block_sparse_attention_cpu, "CPU")
