"""helios' CPU attention kernels against the core's reference op."""

from __future__ import annotations

import pytest
import torch

import helios.core.ops as ops
from helios.engine import kernels


def _case(seed: int, lens: list[int], queries: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 16,
          page_tokens: int = 4):  # fmt: skip
    """A step: sequences with `lens` history tokens, the last `queries[i]` of them queried."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // page_tokens) for n in lens) + 3
    k_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen)
    v_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen)
    order = torch.randperm(pages, generator=gen).tolist()  # scattered pages
    width = max(-(-n // page_tokens) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens):
        for block in range(-(-n // page_tokens)):
            tables[row, block] = order.pop()
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(lens, queries)])
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), starts, positions


CASES = {
    "decode only": ([5, 17, 1, 32], [1, 1, 1, 1]),
    "mixed": ([9, 3, 20, 7], [1, 3, 1, 7]),
    "prefill only": ([12, 6], [12, 2]),
    "whole prompts": ([12, 5], [12, 5]),  # plainly causal chunks
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_matches_the_reference(name: str) -> None:
    lens, queries = CASES[name]
    args = _case(hash(name) % 1000, lens, queries)
    expected = ops.paged_attention(*args, 0.25)
    got = kernels.paged_attention_cpu(*args, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
