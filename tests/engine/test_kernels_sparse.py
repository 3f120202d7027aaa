"""The DeepSeek Sparse Attention ops (helios.core.ops.sparse): the reference kernels and helios'
CPU kernels against direct dense computations (per-query loops over token-by-token history,
an explicit selection mask), including exact ties at the k-th score and rows with fewer
visible keys than k."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops import sparse as ops_sparse
from helios.engine.kernels import sparse as kernels_sparse

PAGE_TOKENS = 4
TOPK = 5
HEADS, DIM = 3, 8  # indexer heads and head size

# (history lengths, queries per sequence): decode rows, prefill chunks after cached history, whole prompts.
CASES = {
    "decode only": ([5, 17, 1, 32], [1, 1, 1, 1]),
    "mixed": ([9, 3, 20, 7, 26], [1, 3, 1, 7, 10]),
    "prefill chunks": ([12, 21], [12, 6]),
    "shorter than k": ([3, 4], [3, 1]),
}


def _tables(gen: torch.Generator, lens: list[int]) -> tuple[int, torch.Tensor]:
    """(pages, block tables) with each sequence's pages scattered over the pool."""
    pages = sum(-(-n // PAGE_TOKENS) for n in lens) + 3
    order = torch.randperm(pages, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(-(-n // PAGE_TOKENS) for n in lens), dtype=torch.int32)
    for row, n in enumerate(lens):
        for block in range(-(-n // PAGE_TOKENS)):
            tables[row, block] = order.pop()
    return pages, tables


def _step(lens: list[int], queries: list[int]) -> tuple[torch.Tensor, ...]:
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(lens, queries)])
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    return torch.tensor(lens, dtype=torch.int32), starts, positions


def _indexer_case(seed: int, lens: list[int], queries: list[int]):
    gen = torch.Generator().manual_seed(seed)
    pages, tables = _tables(gen, lens)
    k_cache = torch.randn(pages, PAGE_TOKENS, 1, DIM, generator=gen)
    # Zero keys score exactly 0 for every query and head: exact ties, ranked among the others
    # because some head weights are negative.
    k_cache.view(-1, DIM)[torch.rand(pages * PAGE_TOKENS, generator=gen) < 0.3] = 0.0
    seq_lens, starts, positions = _step(lens, queries)
    q = torch.randn(int(starts[-1]), HEADS, DIM, generator=gen)
    weights = torch.randn(int(starts[-1]), HEADS, generator=gen)
    return q, weights, k_cache, tables, seq_lens, starts, positions


def _slots(tables: torch.Tensor, seq: int, kv_len: int) -> list[tuple[int, int]]:
    return [(int(tables[seq, j // PAGE_TOKENS]), j % PAGE_TOKENS) for j in range(kv_len)]


def _dense_topk(q, weights, k_cache, tables, seq_lens, starts, positions, scale: float, topk: int) -> torch.Tensor:
    """Per query: every visible key's score in plain loops, ranked by (score desc, position asc)."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    for seq, kv_len in enumerate(seq_lens.tolist()):
        keys = torch.stack([k_cache[p, o, 0] for p, o in _slots(tables, seq, kv_len)])  # [S, D]
        for row in range(int(starts[seq]), int(starts[seq + 1])):
            visible = range(int(positions[row]) + 1)
            score = {
                j: float(sum(weights[row, h] * torch.relu(scale * (q[row, h] @ keys[j])) for h in range(HEADS)))
                for j in visible
            }
            kept = sorted(sorted(visible, key=lambda j: (-score[j], j))[:topk])
            out[row, : len(kept)] = torch.tensor(kept)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_indexer_topk_matches_a_dense_selection(name: str) -> None:
    lens, queries = CASES[name]
    args = _indexer_case(sorted(CASES).index(name), lens, queries)
    expected = _dense_topk(*args, 0.5, TOPK)
    assert torch.equal(ops_sparse.indexer_topk._init_fn(*args, 0.5, TOPK), expected)  # the reference kernel
    assert torch.equal(kernels_sparse.indexer_topk_cpu(*args, 0.5, TOPK), expected)
    assert torch.equal(torch.ops.flare.indexer_topk(*args, 0.5, TOPK), expected)


def test_selection_rule() -> None:
    """Ties at the k-th score go to the earlier key; fewer visible keys than k keep them all."""
    scores = torch.tensor(
        [[1.0, 3.0, 2.0, 2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]
    )
    visible = torch.tensor([[True] * 6, [True] * 6, [True, True, False, False, False, False]])
    got = ops_sparse.select_topk(scores, visible, 3)
    assert got.tolist() == [[1, 2, 3], [0, 1, 2], [0, 1, -1]]
    assert ops_sparse.select_topk(scores[:, :2], visible[:, :2], 3).tolist() == [[0, 1, -1], [0, 1, -1], [0, 1, -1]]


def _attention_case(seed: int, lens: list[int], queries: list[int], heads: int = 4, dim: int = 12):
    gen = torch.Generator().manual_seed(seed)
    pages, tables = _tables(gen, lens)
    latent = torch.randn(pages, PAGE_TOKENS, 1, dim, generator=gen)  # MLA: one tensor as keys and values
    seq_lens, starts, positions = _step(lens, queries)
    rows = int(starts[-1])
    # Random picks, some past the query's position (must be ignored) and some -1.
    indices = torch.randint(-1, max(lens), (rows, TOPK), generator=gen)
    indices[:, 0] = positions  # every row keeps at least its own key
    q = torch.randn(rows, heads, dim, generator=gen)
    return q, latent, latent, tables, seq_lens, starts, positions, indices


def _dense_attention(q, k_cache, v_cache, tables, seq_lens, starts, positions, indices, scale: float) -> torch.Tensor:
    out = torch.zeros_like(q)
    for seq, kv_len in enumerate(seq_lens.tolist()):
        keys = torch.stack([k_cache[p, o, 0] for p, o in _slots(tables, seq, kv_len)])  # [S, D]
        values = torch.stack([v_cache[p, o, 0] for p, o in _slots(tables, seq, kv_len)])
        for row in range(int(starts[seq]), int(starts[seq + 1])):
            chosen = torch.zeros(kv_len, dtype=torch.bool)
            for j in indices[row].tolist():
                if 0 <= j <= int(positions[row]):
                    chosen[j] = True
            scores = (q[row] @ keys.T * scale).masked_fill(~chosen, float("-inf"))  # [H, S]
            out[row] = scores.softmax(-1) @ values
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_sparse_attention_matches_a_dense_mask(name: str) -> None:
    lens, queries = CASES[name]
    args = _attention_case(sorted(CASES).index(name), lens, queries)
    expected = _dense_attention(*args, 0.3)
    torch.testing.assert_close(ops_sparse.sparse_paged_attention._init_fn(*args, 0.3), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels_sparse.sparse_paged_attention_cpu(*args, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_sparse_attention_with_separate_values() -> None:
    q, latent, _, *rest = _attention_case(4, [9, 3, 20], [1, 3, 5])
    values = torch.randn_like(latent)
    expected = _dense_attention(q, latent, values, *rest, 0.3)
    torch.testing.assert_close(
        kernels_sparse.sparse_paged_attention_cpu(q, latent, values, *rest, 0.3), expected, rtol=1e-5, atol=1e-5
    )
