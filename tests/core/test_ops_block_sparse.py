"""The block-sparse ops (helios.core.ops.block_sparse): flare::block_select against transformers'
MiniMaxM3VLIndexer over a paged cache filled in chunks, flare::block_sparse_attention against the
dense-mask attention transformers computes (build_block_mask + eager attention), and helios' CPU
kernels against the reference kernels on mixed decode/prefill batches."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops.block_sparse import block_select, block_sparse_attention
from helios.engine.kernels.block_sparse import block_select_cpu, block_sparse_attention_cpu

PAGE = 4  # page tokens: blocks of 6 straddle pages


def _hf_indexer(heads: int, dim: int, block: int, topk: int, local: int, seed: int):
    from transformers import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer, MiniMaxM3VLRotaryEmbedding

    config = MiniMaxM3VLTextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        index_n_heads=heads,
        index_head_dim=dim,
        index_block_size=block,
        index_topk_blocks=topk,
        index_local_blocks=local,
        layer_types=["minimax_m3_sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    indexer = MiniMaxM3VLIndexer(config, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in indexer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if param.ndim == 1 else 1.0))
    return config, indexer, MiniMaxM3VLRotaryEmbedding(config)


def _indexer_inputs(indexer, rotary, hidden: torch.Tensor):
    """transformers' indexer output [S, Hi, K] and its (normed, rotated) queries/keys, from its own modules."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    total = hidden.shape[1]
    positions = torch.arange(total)[None]
    cos, sin = rotary(hidden, positions)
    with torch.no_grad():
        chosen = indexer(hidden, (cos, sin), None, positions)[0].transpose(0, 1)  # [S, Hi, K']
        q = indexer.q_norm(indexer.q_proj(hidden).view(1, total, -1, indexer.head_dim)).transpose(1, 2)
        k = indexer.k_norm(indexer.k_proj(hidden).view(1, total, 1, indexer.head_dim)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos[..., : indexer.head_dim], sin[..., : indexer.head_dim])
    return chosen, q[0].transpose(0, 1), k[0, 0]  # [S, Hi, D], [S, D]


def _sets(ids: torch.Tensor) -> list[list[frozenset[int]]]:
    return [[frozenset(int(b) for b in row if b >= 0) for row in token] for token in ids]


def _paged(total: int, width: int, heads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty cache of enough pages for `total` tokens, used in reverse order, and the block table."""
    pages = -(-total // PAGE)
    table = torch.tensor([list(reversed(range(pages)))], dtype=torch.int32)
    return torch.zeros(pages, PAGE, heads, width), table


def _slots(table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return torch.tensor([int(table[0, p // PAGE]) * PAGE + p % PAGE for p in range(start, end)])


@pytest.mark.parametrize("heads,block,topk,local", [(2, 6, 3, 1), (1, 4, 4, 2), (2, 5, 2, 0)])
def test_block_select_matches_transformers_indexer(heads: int, block: int, topk: int, local: int) -> None:
    """37 keys in blocks of 4-6: more blocks than topk + local, so blocks are dropped; early queries
    see fewer blocks than topk (-1 padding); the local blocks are always kept."""
    _, indexer, rotary = _hf_indexer(heads, 8, block, topk, local, seed=block)
    total = 37
    hidden = torch.randn(1, total, 32, generator=torch.Generator().manual_seed(1))
    expected, q, k = _indexer_inputs(indexer, rotary, hidden)
    assert -(-total // block) > topk + local
    cache, table = _paged(total, 8)
    got = torch.full((total, heads, topk), -2, dtype=torch.int64)
    for start in range(0, total, 7):  # chunked prefill through the paged cache
        end = min(total, start + 7)
        cache.view(-1, 1, 8).index_copy_(0, _slots(table, start, end), k[start:end, None])
        got[start:end] = block_select(
            q[start:end],
            cache,
            table,
            torch.tensor([end], dtype=torch.int32),
            torch.tensor([0, end - start], dtype=torch.int32),
            torch.arange(start, end),
            block,
            topk,
            local,
        )
    assert _sets(got) == _sets(expected)
    valid = (got >= 0).sum(-1)
    assert torch.equal(valid, torch.clamp(torch.arange(total) // block + 1, max=topk)[:, None].expand(-1, heads))
    assert all(bool((got[t, :, : valid[t, 0]] >= 0).all()) for t in range(total))  # left-packed, -1 after
    for t in range(total):  # the local blocks are among the chosen
        for n in range(local):
            assert all(max(t // block - n, 0) in s for s in _sets(got[t : t + 1])[0])


def _hf_block_attention(q, k, v, chosen, block, scale):
    """transformers' dense path: the indexer's block ids expanded by build_block_mask, then eager attention."""
    from types import SimpleNamespace

    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer, eager_attention_forward

    total, heads = q.shape[0], q.shape[1]
    holder = SimpleNamespace(block_size=block, config=SimpleNamespace(num_attention_heads=heads))
    mask = MiniMaxM3VLIndexer.build_block_mask(
        holder, chosen.transpose(0, 1)[None], None, total, q.dtype, q.device, torch.arange(total)[None]
    )
    module = SimpleNamespace(num_key_value_groups=heads // k.shape[1], training=False)
    out, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale
    )
    return out[0]  # [S, H, D]


@pytest.mark.parametrize("select_heads", [2, 1])
def test_block_sparse_attention_matches_the_dense_mask(select_heads: int) -> None:
    _, indexer, rotary = _hf_indexer(select_heads, 8, 6, 3, 1, seed=3)
    total, gen = 37, torch.Generator().manual_seed(4)
    chosen, _, _ = _indexer_inputs(indexer, rotary, torch.randn(1, total, 32, generator=gen))
    q, k, v = (
        torch.randn(total, 4, 16, generator=gen),
        torch.randn(total, 2, 16, generator=gen),
        torch.randn(total, 2, 16, generator=gen),
    )
    expected = _hf_block_attention(q, k, v, chosen, 6, 0.25)
    k_cache, table = _paged(total, 16, heads=2)
    v_cache = torch.zeros_like(k_cache)
    slots = _slots(table, 0, total)
    k_cache.view(-1, 2, 16).index_copy_(0, slots, k)
    v_cache.view(-1, 2, 16).index_copy_(0, slots, v)
    ids = torch.nn.functional.pad(chosen, (0, 3 - chosen.shape[-1]), value=-1)
    got = block_sparse_attention(
        q,
        k_cache,
        v_cache,
        ids,
        table,
        torch.tensor([total], dtype=torch.int32),
        torch.tensor([0, total], dtype=torch.int32),
        torch.arange(total),
        0.25,
        6,
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    dense = block_sparse_attention(
        q,
        k_cache,
        v_cache,
        torch.arange(7).expand(total, select_heads, 7).contiguous(),
        table,
        torch.tensor([total], dtype=torch.int32),
        torch.tensor([0, total], dtype=torch.int32),
        torch.arange(total),
        0.25,
        6,
    )
    assert float((dense - got).abs().max()) > 1e-2  # the dropped blocks mattered


def _mixed_batch(select_heads: int, kv_heads: int, seed: int):
    """Four sequences over one shared page pool: two decoding, one prefilling a chunk, one whole."""
    gen = torch.Generator().manual_seed(seed)
    lens, queries = [23, 9, 30, 14], [1, 1, 7, 14]
    pages_per = [-(-n // PAGE) for n in lens]
    order = torch.randperm(sum(pages_per), generator=gen).tolist()
    tables, offset = torch.zeros(4, max(pages_per), dtype=torch.int32), 0
    for i, n in enumerate(pages_per):
        tables[i, :n] = torch.tensor(order[offset : offset + n])
        offset += n
    num_pages = sum(pages_per)
    caches = [torch.randn(num_pages, PAGE, h, d, generator=gen) for h, d in ((1, 8), (kv_heads, 16), (kv_heads, 16))]
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(lens, queries)])
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    total = int(starts[-1])
    idx_q, q = torch.randn(total, select_heads, 8, generator=gen), torch.randn(total, 4, 16, generator=gen)
    return caches, tables, torch.tensor(lens, dtype=torch.int32), starts, positions, idx_q, q


@pytest.mark.parametrize("select_heads,kv_heads", [(2, 2), (1, 2), (4, 1)])
def test_cpu_kernels_match_the_reference(select_heads: int, kv_heads: int) -> None:
    (idx_cache, k_cache, v_cache), tables, lens, starts, positions, idx_q, q = _mixed_batch(select_heads, kv_heads, 7)
    for block, topk, local in ((6, 3, 1), (4, 2, 2), (5, 8, 0)):
        args = (tables, lens, starts, positions)
        expected = block_select(idx_q, idx_cache, *args, block, topk, local)
        got = block_select_cpu(idx_q, idx_cache, *args, block, topk, local)
        assert _sets(got) == _sets(expected)
        out = block_sparse_attention(q, k_cache, v_cache, expected, *args, 0.25, block)
        torch.testing.assert_close(
            block_sparse_attention_cpu(q, k_cache, v_cache, expected, *args, 0.25, block), out, rtol=1e-5, atol=1e-5
        )
    # decode rows alone, in order (the kernels' no-scatter path)
    decode = (tables[:2], lens[:2], starts[:3], positions[:2])
    ids = block_select(idx_q[:2], idx_cache, *decode, 4, 2, 1)
    assert _sets(block_select_cpu(idx_q[:2], idx_cache, *decode, 4, 2, 1)) == _sets(ids)
    torch.testing.assert_close(
        block_sparse_attention_cpu(q[:2], k_cache, v_cache, ids, *decode, 0.25, 4),
        block_sparse_attention(q[:2], k_cache, v_cache, ids, *decode, 0.25, 4),
        rtol=1e-5,
        atol=1e-5,
    )
