"""helios' AVX2 attention (helios/engine/native/attention_avx2.cpp): every query row of a step (prompt
chunks, drafts, decode rows) over the paged cache in place, on any x86-64 CPU with AVX2 and FMA (it
is compiled into the library on AVX-512 hosts too, and run here through its own op).

Against the plain-torch reference op on random steps (ragged lengths, page edges, 1-64 query rows,
GQA, windows, soft-capping, fp32 and bfloat16), and the same bits for a row whatever it shares its
step with: decoded alone, beside other rows, or inside a chunk of any length."""

from __future__ import annotations

import platform

import pytest
import torch

from helios.core.ops.base import reference_paged_attention
from helios.engine import native
from tests.engine.test_native_kernels import paged_step

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or not (native.load() and torch.ops.flare_native.has_avx2_linear()),
    reason="not an x86-64 CPU with AVX2 and FMA, or no C++ compiler for helios' native kernels",
)

# dtype, cache dtype, heads, kv heads, head size, page tokens
LAYOUTS = {
    "fp32 gqa": (torch.float32, torch.float32, 9, 3, 64, 16),
    "bf16 gqa": (torch.bfloat16, torch.bfloat16, 9, 3, 64, 16),
    "fp32 over bf16": (torch.float32, torch.bfloat16, 4, 2, 128, 4),
    "bf16 over fp32, no gqa": (torch.bfloat16, torch.float32, 3, 3, 32, 8),
    "fp32 odd group": (torch.float32, torch.float32, 14, 2, 24, 5),
    "bf16 big group, 256": (torch.bfloat16, torch.bfloat16, 8, 1, 256, 16),
}


def _step(seed: int, layout: str, history: list[int], queries: list[int]):
    """A step: per sequence `history` keys after it and its last `queries` of them as query rows."""
    dtype, cache_dtype, heads, kv_heads, dim, page_tokens = LAYOUTS[layout]
    return paged_step(seed, dtype, cache_dtype, heads, kv_heads, dim, history, queries, page_tokens)


def _avx2(*args) -> torch.Tensor:
    return torch.ops.flare_native.avx2_attention(*args)


def _reference(q, k_cache, v_cache, *rest) -> torch.Tensor:
    """The reference op in fp32 (of the same inputs)."""
    return reference_paged_attention(q.float(), k_cache.float(), v_cache.float(), *rest)


STEPS = {  # keys per sequence after the step, query rows per sequence
    "decode rows": ([1, 17, 40, 100, 5, 64, 65, 129], [1] * 8),
    "one prompt": ([77], [77]),
    "a chunk after a prefix": ([200], [45]),
    "mixed with an idle sequence": ([30, 3, 150, 64], [1, 0, 64, 2]),
    "drafts under verification": ([9, 130, 2], [3, 7, 1]),
}


# Beside plain causal attention, each (layout, step) pair also runs one of these (window, softcap)
# settings, in turn: every setting meets every layout and every step.
OPTIONS = [(23, 0.0), (0, 30.0), (70, 5.0)]


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_the_reference(layout: str, step: str) -> None:
    history, queries = STEPS[step]
    option = OPTIONS[(sorted(LAYOUTS).index(layout) + sorted(STEPS).index(step)) % len(OPTIONS)]
    for window, softcap in ((0, 0.0), option):
        args = (*_step(len(layout + step) + window, layout, history, queries), 0.125, window, softcap)
        got = _avx2(*args)
        assert got.dtype == args[0].dtype and got.shape == args[0].shape
        expected = _reference(*args)
        tolerance = 1e-5 if args[0].dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("layout", ["fp32 gqa", "bf16 gqa", "fp32 odd group"])
@pytest.mark.parametrize("window", [0, 50])
def test_a_rows_bits_do_not_depend_on_its_step(layout: str, window: int) -> None:
    """A prompt attended whole, in chunks of any length, or row by row as decode rows beside other
    sequences: every query row gets the same bits (64-key tiles at absolute positions)."""
    n = 300
    q, k_cache, v_cache, tables, lens, starts, positions = _step(5, layout, [n], [n])
    whole = _avx2(q, k_cache, v_cache, tables, lens, starts, positions, 0.125, window, 0.0)

    def chunk(a: int, b: int) -> torch.Tensor:
        rows = torch.tensor([0, b - a], dtype=torch.int32)
        return _avx2(
            q[a:b],
            k_cache,
            v_cache,
            tables,
            torch.tensor([b], dtype=torch.int32),
            rows,
            positions[a:b],
            0.125,
            window,
            0.0,
        )

    for cuts in ((100,), (7, 200), (64, 128, 298), (13, 15, 17, 63, 65)):
        edges = [0, *cuts, n]
        assert torch.equal(torch.cat([chunk(a, b) for a, b in zip(edges, edges[1:])]), whole), cuts
    # every row as a decode row of its own sequence (same pages), 64 of them in one step
    rows = torch.arange(n - 64, n)
    decoded = _avx2(
        q[rows],
        k_cache,
        v_cache,
        tables.expand(64, -1).contiguous(),
        (rows + 1).int(),
        torch.arange(65, dtype=torch.int32),
        positions[rows],
        0.125,
        window,
        0.0,
    )
    assert torch.equal(decoded, whole[rows])
    alone = chunk(n - 1, n)
    assert torch.equal(alone[0], whole[n - 1])


def test_thread_count_does_not_change_a_bit() -> None:
    args = (*_step(9, "bf16 gqa", [150, 90, 33], [60, 1, 33]), 0.125, 0, 0.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _avx2(*args)
        torch.set_num_threads(max(2, before))
        assert torch.equal(_avx2(*args), one)
    finally:
        torch.set_num_threads(before)


def test_padding_rows_and_unseen_keys() -> None:
    """Query rows past the last sequence's are zero; a row that sees no key (its window past the
    mapped pages) is zero, as the decode kernel leaves it."""
    q, k_cache, v_cache, tables, lens, starts, positions = _step(2, "fp32 gqa", [40, 20], [4, 1])
    padded = torch.cat([q, torch.ones(3, *q.shape[1:])])
    out = _avx2(
        padded, k_cache, v_cache, tables, lens, starts, torch.cat([positions, torch.zeros(3).long()]), 0.125, 0, 0.0
    )
    assert torch.equal(out[-3:], torch.zeros(3, *q.shape[1:]))
    torch.testing.assert_close(
        out[:-3], _reference(q, k_cache, v_cache, tables, lens, starts, positions, 0.125, 0, 0.0)
    )
    # the second sequence's row at position 60 with a window of 5 keys: 56..60, none of them among its 20
    unseen = positions.clone()
    unseen[4] = 60
    out = _avx2(q, k_cache, v_cache, tables, lens, starts, unseen, 0.125, 5, 0.0)
    assert torch.equal(out[4], torch.zeros_like(out[4])) and bool(out[:4].abs().sum() > 0)
    torch.testing.assert_close(
        out[:4], _reference(q, k_cache, v_cache, tables, lens, starts, positions, 0.125, 5, 0.0)[:4]
    )


def test_the_op_serves_the_layers_it_covers() -> None:
    """flare::paged_attention takes this kernel for fp32 layers, and for bfloat16 ones where the
    AVX512-BF16 tiles are absent (an AVX2 host) or do not apply (soft-capping)."""
    args = (*_step(4, "fp32 gqa", [70, 12], [70, 1]), 0.125, 0, 0.0)
    assert torch.equal(torch.ops.flare.paged_attention(*args), _avx2(*args))
    capped = (*_step(4, "bf16 gqa", [70, 12], [70, 1]), 0.125, 0, 20.0)
    assert torch.equal(torch.ops.flare.paged_attention(*capped), _avx2(*capped))
    q, k_cache = capped[0], capped[1]
    assert torch.ops.flare_native.has_avx2_attention(q, k_cache)
    assert not torch.ops.flare_native.has_avx2_attention(q[..., :60], k_cache[..., :60])  # head size 60
    assert not torch.ops.flare_native.has_avx2_attention(q.half(), k_cache)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        _avx2(q.half(), *capped[1:])
