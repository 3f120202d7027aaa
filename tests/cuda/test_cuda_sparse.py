"""helios' Triton kernels for the sparse-attention ops (helios.engine.cuda.sparse) under Triton's
interpreter, against the core's reference kernels on random scattered pages: block-sparse
(MiniMax M3), DSA (indexer top-k, sparse attention), DeepSeek-V4 (pool, indexer, attention) and
GLM's k-pool indexer. Decode rows, prefill chunks, padding rows, ties, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops import block_sparse as ops_block_sparse
from helios.core.ops import deepseek_v4 as ops_dsv4
from helios.core.ops import glm5_next as ops_glm5
from helios.core.ops import sparse as ops_sparse
from helios.engine.cuda import sparse
from tests.cuda.paged_steps import assert_close, captured, paged_step, reference, sweep

PAGE_TOKENS = 4
# (history lengths, queries per sequence); a length-0 sequence is a padding row
STEPS = {
    "decode": ([5, 16, 0, 12], [1, 1, 1, 1]),
    "mixed": ([9, 3, 14, 0], [1, 3, 4, 1]),
    "prefill chunks": ([7, 13], [7, 4]),
}
FP32, BF16 = torch.float32, torch.bfloat16
DTYPES = [FP32, BF16]


def _setup(name: str, seed: int, page_tokens: int = PAGE_TOKENS):
    gen = torch.Generator().manual_seed(seed)
    lens, queries = STEPS[name]
    return gen, paged_step(gen, lens, queries, page_tokens)


def _dsv4_setup(name: str, seed: int):
    """The DeepSeek-V4 ops have no sequence lengths: a padding row is a captured bucket's (position
    0 in a sequence whose block table names only the scratch page), not a length-0 sequence."""
    gen, step = _setup(name, seed)
    return gen, step._replace(positions=step.positions.clamp(min=0))


@pytest.mark.parametrize("name", sorted(STEPS))
def test_indexer_topk_matches_thereference(name: str) -> None:
    gen, step = _setup(name, 1)
    heads, dim = 3, 8
    k_cache = torch.randn(step.num_pages, PAGE_TOKENS, 1, dim, generator=gen)
    # Zero keys score exactly 0 for every query: exact ties, which go to the earlier key.
    k_cache.view(-1, dim)[torch.rand(step.num_pages * PAGE_TOKENS, generator=gen) < 0.3] = 0.0
    tokens = step.positions.shape[0]
    q = torch.randn(tokens, heads, dim, generator=gen)
    weights = torch.randn(tokens, heads, generator=gen)
    args = (q, weights, k_cache, step.block_tables, step.seq_lens, step.query_start_loc, step.positions, 0.5, 5)
    got = captured(sparse.indexer_topk, *args)
    assert torch.equal(got, reference(ops_sparse.indexer_topk)(*args))


def _kv(gen: torch.Generator, step, kv_heads: int, dim: int, dtype: torch.dtype):
    shape = (step.num_pages, PAGE_TOKENS, kv_heads, dim)
    return torch.randn(*shape, generator=gen).to(dtype), torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("name", "dtype"), sweep(STEPS, DTYPES, sample=[("decode", BF16), ("mixed", FP32), ("prefill chunks", FP32)])
)
def test_sparse_paged_attention_matches_thereference(name: str, dtype: torch.dtype) -> None:
    """Listed keys with -1, keys past the query (ignored), repeats (counted once), GQA 3."""
    gen, step = _setup(name, 2)
    k_cache, v_cache = _kv(gen, step, 2, 12, dtype)
    tokens = step.positions.shape[0]
    q = torch.randn(tokens, 6, 12, generator=gen).to(dtype)
    indices = torch.randint(-1, 34, (tokens, 7), generator=gen)
    indices[:, 0] = step.positions.clamp(min=0)  # every live query sees a key
    indices[:, 1] = indices[:, 2]
    args = (q, k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start_loc, step.positions)
    got = captured(sparse.sparse_paged_attention, *args, indices, 0.3)
    assert_close(got, reference(ops_sparse.sparse_paged_attention)(*args, indices, 0.3), dtype)


def _same_selection(got: torch.Tensor, expected: torch.Tensor, scores_tie: torch.Tensor) -> None:
    """Equal rows, except that entries tied at +inf (the local blocks) may come in any order."""
    assert torch.equal(got.sort(dim=-1).values, expected.sort(dim=-1).values)
    assert torch.equal(got[..., ~scores_tie], expected[..., ~scores_tie])


@pytest.mark.parametrize(
    ("name", "local_blocks"), sweep(STEPS, [0, 1, 2], sample=[("decode", 1), ("mixed", 2), ("prefill chunks", 0)])
)
def test_block_select_matches_thereference(name: str, local_blocks: int) -> None:
    gen, step = _setup(name, 3)
    heads, dim, block_size, topk = 2, 8, 3, 4  # blocks straddle pages
    idx_k = torch.randn(step.num_pages, PAGE_TOKENS, 1, dim, generator=gen)
    idx_q = torch.randn(step.positions.shape[0], heads, dim, generator=gen)
    args = (idx_q, idx_k, step.block_tables, step.seq_lens, step.query_start_loc, step.positions)
    got = captured(sparse.block_select, *args, block_size, topk, local_blocks)
    expected = reference(ops_block_sparse.block_select)(*args, block_size, topk, local_blocks)
    _same_selection(got, expected, torch.arange(topk) < local_blocks)


HEADS = [(4, 2, 2), (6, 3, 2), (4, 1, 4)]  # (query heads, selection heads, kv heads)


@pytest.mark.parametrize(
    ("name", "heads", "dtype"),
    sweep(
        STEPS,
        HEADS,
        DTYPES,
        sample=[("decode", (6, 3, 2), FP32), ("mixed", (4, 1, 4), BF16), ("prefill chunks", (4, 2, 2), FP32)],
    ),
)
def test_block_sparse_attention_matches_thereference(
    name: str, heads: tuple[int, int, int], dtype: torch.dtype
) -> None:
    """Selections from flare::block_select, plus -1 entries and a block listed twice."""
    heads, select_heads, kv_heads = heads
    gen, step = _setup(name, 4)
    dim, block_size = 12, 3
    idx_k = torch.randn(step.num_pages, PAGE_TOKENS, 1, 8, generator=gen)
    idx_q = torch.randn(step.positions.shape[0], select_heads, 8, generator=gen)
    paged = (step.block_tables, step.seq_lens, step.query_start_loc, step.positions)
    blocks = reference(ops_block_sparse.block_select)(idx_q, idx_k, *paged, block_size, 3, 1)
    blocks = torch.cat([blocks, blocks[..., :1]], dim=-1)  # the first block again
    k_cache, v_cache = _kv(gen, step, kv_heads, dim, dtype)
    q = torch.randn(step.positions.shape[0], heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, blocks, *paged, 0.3, block_size)
    got = captured(sparse.block_sparse_attention, *args)
    assert_close(got, reference(ops_block_sparse.block_sparse_attention)(*args), dtype)


@pytest.mark.parametrize(
    ("name", "rate", "overlap"),
    sweep(
        STEPS, [2, 3, 4], [True, False], sample=[("mixed", 2, True), ("prefill chunks", 3, True), ("decode", 4, False)]
    ),
)
def test_dsv4_pool_matches_thereference(name: str, rate: int, overlap: bool) -> None:
    gen, step = _dsv4_setup(name, 5)
    dim = 6
    width = 2 * dim if overlap else dim
    state = torch.randn(step.num_pages, PAGE_TOKENS, 1, 2 * width, generator=gen)
    args = (state, step.block_tables, step.query_start_loc, step.positions, rate, overlap)
    got = captured(sparse.dsv4_pool, *args)
    torch.testing.assert_close(got, reference(ops_dsv4.dsv4_pool)(*args), rtol=1e-5, atol=1e-5)
    assert got.abs().sum(-1).gt(0).any()  # some token completes a group


def _dsv4_indexer(gen: torch.Generator, step, rate: int):
    heads, dim = 3, 8
    key_cache = torch.randn(step.num_pages, PAGE_TOKENS, 1, dim, generator=gen)
    tokens = step.positions.shape[0]
    q = torch.randn(tokens, heads, dim, generator=gen)
    weights = torch.randn(tokens, heads, generator=gen)
    return (q, weights, key_cache, step.block_tables, step.query_start_loc, step.positions, rate, 3, 0.5)


def _entry_scores(args: tuple, ids: torch.Tensor) -> torch.Tensor:
    """The indexer's score of each listed entry (the reference's formula), -inf for -1."""
    q, weights, key_cache, tables, starts, positions, rate, _, scale = args
    seqs = ops_dsv4.token_sequences(starts, positions.shape[0])
    slots = ops_dsv4.slots_of(tables, seqs[:, None], (ids.clamp(min=0) + 1) * rate - 1, key_cache.shape[1])
    keys = key_cache.reshape(-1, key_cache.shape[-1])[slots]  # [T, k, d]
    per_head = torch.einsum("thd,tkd->thk", q, keys).relu() * scale * weights[..., None]
    return per_head.sum(1).masked_fill(ids < 0, float("-inf"))


@pytest.mark.parametrize("name", sorted(STEPS))
def test_dsv4_indexer_topk_matches_thereference(name: str) -> None:
    """Best first; entries tied in score (several score exactly 0 after the ReLU) in any order."""
    gen, step = _dsv4_setup(name, 6)
    args = _dsv4_indexer(gen, step, 2)
    got = captured(sparse.dsv4_indexer_topk, *args)
    expected = reference(ops_dsv4.dsv4_indexer_topk)(*args)
    torch.testing.assert_close(_entry_scores(args, got), _entry_scores(args, expected), rtol=1e-5, atol=1e-5)
    assert torch.equal(got >= 0, expected >= 0)
    listed = got.sort(dim=-1).values
    assert not ((listed[:, 1:] == listed[:, :-1]) & (listed[:, 1:] >= 0)).any()  # each entry once


@pytest.mark.parametrize(
    ("name", "entries", "dtype"),
    sweep(
        STEPS,
        ["none", "all", "selected"],
        DTYPES,
        sample=[("decode", "none", FP32), ("mixed", "all", BF16), ("prefill chunks", "selected", FP32)],
    ),
)
def test_dsv4_attention_matches_thereference(name: str, entries: str, dtype: torch.dtype) -> None:
    gen, step = _dsv4_setup(name, 7)
    heads, dim, rate, window = 18, 20, 2, 5  # more heads than one program's tile
    kv_cache = torch.randn(step.num_pages, PAGE_TOKENS, 1, dim, generator=gen).to(dtype)
    entry_cache = torch.randn(step.num_pages, PAGE_TOKENS, 1, dim, generator=gen).to(dtype)
    q = torch.randn(step.positions.shape[0], heads, dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    selected = None
    if entries == "selected":
        selected = reference(ops_dsv4.dsv4_indexer_topk)(*_dsv4_indexer(gen, step, rate))
    cache = None if entries == "none" else entry_cache
    args = (q, kv_cache, cache, step.block_tables, step.query_start_loc, step.positions, sinks, 0.3, window, rate)
    got = captured(sparse.dsv4_attention, *args, selected)
    assert_close(got, reference(ops_dsv4.dsv4_attention)(*args, selected), dtype)


@pytest.mark.parametrize(
    ("name", "tail"), sweep(STEPS, [True, False], sample=[("decode", True), ("mixed", False), ("prefill chunks", True)])
)
def test_kpool_topk_matches_thereference(name: str, tail: bool) -> None:
    gen, step = _setup(name, 8)
    heads, dim, pool = 3, 8, 3  # pools straddle pages
    cache = torch.randn(step.num_pages, PAGE_TOKENS, 1, 2 * dim, generator=gen)
    ape = torch.randn(pool, dim, generator=gen)
    tokens = step.positions.shape[0]
    q = torch.randn(tokens, heads, dim, generator=gen)
    weights = torch.randn(tokens, heads, generator=gen)
    paged = (step.block_tables, step.seq_lens, step.query_start_loc, step.positions)
    args = (q, weights, cache, ape, *paged, 0.5, pool, 2, tail)
    got = captured(sparse.kpool_topk, *args)
    assert torch.equal(got, reference(ops_glm5.kpool_topk)(*args))


def test_every_sparse_op_is_registered_for_cuda() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def impl(self, name: str, fn: object, key: str) -> None:
            self.calls.append((name, key))

    library = Recorder()
    sparse.register(library)  # type: ignore[arg-type]
    assert sorted(library.calls) == sorted((name, "CUDA") for name in sparse.OPS)
    assert set(sparse.OPS) == {
        "block_select",
        "block_sparse_attention",
        "indexer_topk",
        "sparse_paged_attention",
        "dsv4_pool",
        "dsv4_indexer_topk",
        "dsv4_attention",
        "kpool_topk",
    }
