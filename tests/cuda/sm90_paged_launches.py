"""The attention and sparse families' kernel launches for tests.cuda.sm90_launches (which compiles each
distinct launch for an H100/H200, sm_90, down to a cubin without a GPU).

Run in a process without TRITON_INTERPRET: `python -m tests.cuda.sm90_paged_launches [GROUP...]`
with groups `attention`, `sparse` (all of their launches) or `sample` (three of them, for CI);
prints one line per compiled kernel and exits 1 if any failed to compile.
"""

from __future__ import annotations

import sys

import torch

from tests.cuda.paged_steps import paged_step
from tests.cuda.sm90_launches import main

PAGE = 16


def _step(lens: list[int], queries: list[int]):
    return paged_step(torch.Generator().manual_seed(0), lens, queries, PAGE)


def _attention_args(dtype: torch.dtype, lens: list[int], queries: list[int], heads: int, kv_heads: int, dim: int):
    step = _step(lens, queries)
    cache = torch.randn(step.num_pages, PAGE, kv_heads, dim).to(dtype)
    q = torch.randn(step.positions.shape[0], heads, dim).to(dtype)
    return q, cache, cache.clone(), step.block_tables, step.seq_lens, step.query_start_loc, step.positions


def _decode_one_row() -> None:
    from helios.engine.cuda import attention

    attention.paged_attention(*_attention_args(torch.bfloat16, [9], [1], 9, 3, 64), 0.1, 4, 0.0)


def attention_launches() -> None:
    """Every kernel of helios.engine.cuda.attention in its variants: decode and prefill row blocks,
    bf16 and fp32, GQA, window, soft-cap, until, sinks with a narrower value."""
    from helios.engine.cuda import attention

    _decode_one_row()
    for dtype in (torch.bfloat16, torch.float32):
        decode = _attention_args(dtype, [40, 9, 0], [1, 1, 1], 8, 2, 128)
        prefill = _attention_args(dtype, [70, 12], [30, 12], 4, 4, 72)
        attention.write_kv(decode[1], decode[2], decode[0][:, :2], decode[0][:, :2], decode[-1])
        attention.paged_attention(*decode, 0.1, 0, 0.0)
        attention.paged_attention(*prefill, 0.1, 0, 30.0)
        attention.paged_attention_until(*prefill, prefill[-1], 0.1, 8, 0.0)
        attention.sink_attention(decode[0][..., :96], decode[1], *decode[3:], 0.1, 0, torch.zeros(8))


def _sparse_step():
    step = _step([33, 20], [4, 1])
    return step, (step.block_tables, step.seq_lens, step.query_start_loc, step.positions)


def _sparse_attention() -> None:
    from helios.engine.cuda import sparse

    step, paged = _sparse_step()
    tokens = step.positions.shape[0]
    kv = torch.randn(step.num_pages, PAGE, 2, 128).bfloat16()
    q = torch.randn(tokens, 8, 128).bfloat16()
    sparse.sparse_paged_attention(q, kv, kv, *paged, torch.zeros(tokens, 64, dtype=torch.int64), 0.1)
    sparse.block_sparse_attention(q, kv, kv, torch.zeros(tokens, 2, 4, dtype=torch.int64), *paged, 0.1, 16)


def _dsv4_attention() -> None:
    from helios.engine.cuda import deepseek_v4

    step, _ = _sparse_step()
    tokens, unpaged = step.positions.shape[0], (step.block_tables, step.query_start_loc, step.positions)
    q, kv = torch.randn(tokens, 16, 512).bfloat16(), torch.randn(step.num_pages, PAGE, 1, 512).bfloat16()
    selected = torch.zeros(tokens, 8, dtype=torch.int64)
    deepseek_v4.dsv4_attention(q, kv, kv, *unpaged, torch.zeros(16), 0.1, 128, 4, selected)
    deepseek_v4.dsv4_attention(q, kv, None, *unpaged, torch.zeros(16), 0.1, 128, 0, None)


def sparse_launches() -> None:
    """Every kernel of helios.engine.cuda.sparse and .deepseek_v4."""
    from helios.engine.cuda import deepseek_v4, sparse

    _sparse_attention()
    _dsv4_attention()
    step, paged = _sparse_step()
    tokens, unpaged = step.positions.shape[0], paged[:1] + paged[2:]
    index_q, index_w = torch.randn(tokens, 4, 64), torch.randn(tokens, 4)
    index_cache = torch.randn(step.num_pages, PAGE, 1, 64).bfloat16()
    sparse.indexer_topk(index_q, index_w, index_cache, *paged, 0.1, 8)
    sparse.kpool_topk(index_q[..., :32], index_w, index_cache, torch.zeros(4, 32), *paged, 0.1, 4, 2, True)
    sparse.dsv4_indexer_topk(index_q, index_w, index_cache, *unpaged, 4, 8, 0.1)
    sparse.block_select(index_q.bfloat16(), index_cache, *paged, 16, 4, 1)
    for overlap in (True, False):
        deepseek_v4.dsv4_pool(torch.randn(step.num_pages, PAGE, 1, 4 * 64).bfloat16(), *unpaged, 4, overlap)


def sample_launches() -> None:
    """Three representative kernels: what CI compiles."""
    _decode_one_row()
    _sparse_attention()


GROUPS = {"attention": attention_launches, "sparse": sparse_launches, "sample": sample_launches}


if __name__ == "__main__":
    sys.exit(main(GROUPS, sys.argv[1:] or ["attention", "sparse"]))
