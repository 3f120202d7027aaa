"""helios' CPU attention kernels against the core's reference op, with decode rows attended by
the native kernel and by the Python gather path."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops.base import reference_paged_attention
from helios.core.ops.sinks import sink_attention
from helios.engine import native
from helios.engine.kernels import attention
from helios.engine.kernels.attention import paged_attention_cpu
from helios.engine.kernels.sinks import sink_attention_cpu


@pytest.fixture(autouse=True, params=["native", "python"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs once per decode-attention path."""
    if request.param == "native":
        if native._compiler() is None:
            pytest.skip("no C++ compiler: the native kernels cannot be built here")
        assert native.load(), native.status()
    else:
        monkeypatch.setattr(attention, "_native", False)  # as where the native library did not load
    return request.param


def _case(
    seed: int,
    lens: list[int],
    queries: list[int],
    heads: int = 6,
    kv_heads: int = 2,
    dim: int = 16,
    page_tokens: int = 4,
):
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
    expected = reference_paged_attention(*args, 0.25)
    got = paged_attention_cpu(*args, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _dense(q, k_cache, v_cache, tables, lens, starts, positions, scale: float, window: int, softcap: float):
    """Per-query loops over token-by-token gathered history: an explicit-mask reference."""
    page_tokens, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for seq, kv_len in enumerate(lens.tolist()):
        slots = [(int(tables[seq, j // page_tokens]), j % page_tokens) for j in range(kv_len)]
        keys = torch.stack([k_cache[p, o] for p, o in slots]).repeat_interleave(group, dim=1)  # [Tk, H, D]
        values = torch.stack([v_cache[p, o] for p, o in slots]).repeat_interleave(group, dim=1)
        for row in range(int(starts[seq]), int(starts[seq + 1])):
            p = int(positions[row])
            scores = torch.einsum("hd,thd->ht", q[row], keys) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            j = torch.arange(kv_len)
            scores[:, (j > p) | ((j <= p - window) if window else torch.zeros_like(j, dtype=torch.bool))] = float(
                "-inf"
            )
            out[row] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


WINDOWED = {  # (lens, queries, window, softcap); page_tokens is 4
    "decode, window < page": ([5, 17, 1, 32], [1, 1, 1, 1], 3, 0.0),
    "decode, window > page": ([5, 17, 1, 32], [1, 1, 1, 1], 9, 0.0),
    "decode, capped": ([5, 17, 1, 32], [1, 1, 1, 1], 0, 2.0),
    "prefill chunks, window < page": ([12, 21], [12, 6], 3, 0.0),
    "prefill chunks, window > page": ([12, 21], [5, 13], 6, 0.0),
    "whole prompts shorter than the window": ([7, 5], [7, 5], 8, 0.0),
    "whole prompts longer than the window": ([12, 9], [12, 9], 5, 0.0),
    "whole prompts, capped": ([12, 5], [12, 5], 0, 1.5),
    "mixed, window and cap": ([9, 3, 20, 7, 26], [1, 3, 1, 7, 10], 6, 3.0),
    "mixed, window wider than history": ([9, 3, 20, 7], [1, 3, 1, 7], 64, 0.0),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_and_capped_kernels_match_a_dense_reference(name: str) -> None:
    lens, queries, window, softcap = WINDOWED[name]
    args = _case(sorted(WINDOWED).index(name), lens, queries)
    dense = _dense(*args, 0.25, window, softcap)
    reference = reference_paged_attention(*args, 0.25, window, softcap)
    torch.testing.assert_close(reference, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_attention_cpu(*args, 0.25, window, softcap), dense, rtol=1e-5, atol=1e-5)


def test_layers_with_different_windows_share_a_step() -> None:
    """Sliding and global layers alternate within one step: each call gets its own window's layout."""
    args = _case(7, [9, 3, 20, 7], [1, 3, 1, 7])
    for window in (4, 0, 4, 0):
        torch.testing.assert_close(
            paged_attention_cpu(*args, 0.25, window), _dense(*args, 0.25, window, 0.0), rtol=1e-5, atol=1e-5
        )


def test_programs_exported_before_the_options_still_call_the_op() -> None:
    """Eight arguments (format v1 programs) mean global, uncapped attention."""
    args = _case(3, [9, 3, 20], [1, 3, 4])
    torch.testing.assert_close(
        torch.ops.flare.paged_attention(*args, 0.25), _dense(*args, 0.25, 0, 0.0), rtol=1e-5, atol=1e-5
    )


def test_sink_attention_in_the_same_step_keeps_its_own_layout(decode_path: str) -> None:
    """A step whose layers mix flare::paged_attention and flare::sink_attention with one window
    (MiMo-style): the paged layer's in-place plan must not stand in for the sink layer's gather."""
    q, k_cache, v_cache, tables, lens, starts, positions = _case(11, [9, 3, 20, 7], [1, 3, 1, 7])
    packed = torch.cat([k_cache, v_cache], dim=-1)  # key then value per kv head
    paged_attention_cpu(q, k_cache, v_cache, tables, lens, starts, positions, 0.25, 4)
    got = sink_attention_cpu(q, packed, tables, lens, starts, positions, 0.25, 4, None)
    torch.testing.assert_close(
        got, sink_attention(q, packed, tables, lens, starts, positions, 0.25, 4, None), rtol=1e-5, atol=1e-5
    )
