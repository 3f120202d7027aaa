"""helios' native CPU kernels (helios/engine/native) against the flare:: reference ops."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support import attend_spans

from helios.core.ops.base import reference_paged_attention, reference_write_kv
from helios.engine import native

pytestmark = pytest.mark.skipif(
    native._compiler() is None, reason="no C++ compiler: the native kernels cannot be built"
)


@pytest.fixture(scope="module", autouse=True)
def loaded() -> None:
    assert native.load(), native.status()


def paged_step(
    seed: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    history: list[int],
    queries: list[int] | None = None,
    page_tokens: int = 16,
):
    """A step over a random paged cache: each sequence has `history` keys after the step and its
    last `queries` of them as query rows (None: one each, a decode step) -> the op's arguments
    up to `positions`."""
    queries = [1] * len(history) if queries is None else queries
    gen = torch.Generator().manual_seed(seed)
    blocks = max(-(-n // page_tokens) for n in history)
    pages = len(history) * blocks + 2
    k_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(pages, generator=gen)[: len(history) * blocks].view(len(history), blocks).int()
    q = torch.randn(sum(queries), heads, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(history, queries)]).long()
    return q, k_cache, v_cache, tables, torch.tensor(history, dtype=torch.int32), starts, positions


DECODE = {  # dtype, cache dtype, heads, kv heads, head size, window, softcap
    "fp32 gqa": (torch.float32, torch.float32, 9, 3, 64, 0, 0.0),
    "fp32 window": (torch.float32, torch.float32, 9, 3, 64, 8, 0.0),
    "fp32 capped": (torch.float32, torch.float32, 4, 2, 128, 0, 30.0),
    "fp32 window and cap": (torch.float32, torch.float32, 8, 1, 256, 20, 50.0),
    "fp32 odd head size (run-time size)": (torch.float32, torch.float32, 6, 2, 80, 0, 0.0),
    "bf16": (torch.bfloat16, torch.bfloat16, 9, 3, 64, 0, 0.0),
    "bf16 window": (torch.bfloat16, torch.bfloat16, 4, 4, 128, 5, 0.0),
    "fp32 queries over a bf16 cache": (torch.float32, torch.bfloat16, 9, 3, 64, 0, 0.0),
    "fp16 cache": (torch.float32, torch.float16, 4, 2, 64, 0, 0.0),
}


@pytest.mark.parametrize("name", sorted(DECODE))
def test_decode_attention_matches_the_reference_op(name: str) -> None:
    dtype, cache_dtype, heads, kv_heads, dim, window, softcap = DECODE[name]
    lens = [1, 17, 40, 100, 5, 64, 65]  # one token, page edges, several key chunks
    q, k_cache, v_cache, tables, seq_lens, starts, positions = paged_step(
        len(name), dtype, cache_dtype, heads, kv_heads, dim, lens
    )
    expected = reference_paged_attention(
        q, k_cache, v_cache, tables, seq_lens, starts, positions, 0.125, window, softcap
    )
    got = torch.ops.flare_native.decode_attention(
        q, k_cache, v_cache, tables, seq_lens, positions, 0.125, window, softcap
    )
    assert got.dtype == q.dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_decode_rows_do_not_depend_on_their_neighbours() -> None:
    """A row's output is bit-identical alone and in a batch (batching invariance)."""
    q, k_cache, v_cache, tables, seq_lens, _, positions = paged_step(
        3, torch.bfloat16, torch.bfloat16, 9, 3, 64, [30, 7, 99]
    )
    together = torch.ops.flare_native.decode_attention(q, k_cache, v_cache, tables, seq_lens, positions, 0.125, 0, 0.0)
    for row in range(3):
        alone = torch.ops.flare_native.decode_attention(
            q[row : row + 1],
            k_cache,
            v_cache,
            tables[row : row + 1],
            seq_lens[row : row + 1],
            positions[row : row + 1],
            0.125,
            0,
            0.0,
        )
        assert torch.equal(alone[0], together[row])


def test_bad_shapes_are_refused_with_an_error_not_a_crash() -> None:
    q, k_cache, v_cache, tables, seq_lens, _, positions = paged_step(1, torch.float32, torch.float32, 9, 3, 64, [5])
    with pytest.raises(RuntimeError, match="head layout"):
        torch.ops.flare_native.decode_attention(q[:, :8], k_cache, v_cache, tables, seq_lens, positions, 0.1, 0, 0.0)
    with pytest.raises(RuntimeError, match="block_tables"):
        torch.ops.flare_native.decode_attention(q, k_cache, v_cache, tables.long(), seq_lens, positions, 0.1, 0, 0.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_reference_op(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    caches = [torch.zeros(6, 4, 2, 8, dtype=cache_dtype) for _ in range(4)]
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([3, -1, 17, 0, -1])  # negative slots are padding
    reference_write_kv(caches[0], caches[1], k, v, slots)
    torch.ops.flare_native.write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.flare_native.write_kv(caches[2], caches[3], k[:1], v[:1], torch.tensor([24]))


def _load_in_a_fresh_process(env: dict[str, str]) -> str:
    code = "from helios.engine import native; native.load(); print(native.status())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() + done.stderr


def test_switched_off_by_the_environment() -> None:
    assert _load_in_a_fresh_process({"FLARE_NATIVE_KERNELS": "0"}).startswith("python (FLARE_NATIVE_KERNELS=0)")


def test_a_failed_build_falls_back_to_the_python_kernels(tmp_path) -> None:
    out = _load_in_a_fresh_process({"FLARE_CACHE_DIR": str(tmp_path), "CXX": "/bin/false"})
    assert out.startswith("python (compiling ") and " failed" in out and "using the Python kernels" in out
    assert not list((tmp_path / "native").glob("*.so"))  # nothing half-built is left to load next time


needs_bf16 = pytest.mark.skipif(
    not (native.load() and torch.ops.flare_native.has_bf16_linear()),
    reason="this CPU/compiler has no AVX512-BF16: the native linear is not built",
)
needs_amx = pytest.mark.skipif(
    not (native.load() and torch.ops.flare_native.has_amx_linear()),
    reason="this CPU/compiler has no AMX-BF16: linear_tiles runs the AVX512-BF16 path",
)
SHAPES = [
    (1, 960, 576, False),
    (5, 100, 64, True),
    (33, 300, 128, False),
    (0, 32, 16, False),
    (7, 17, 6, True),
    (13, 64, 1536, True),
    (16, 48, 1536, False),
    (64, 1000, 576, False),
    (0, 32, 32, False),
]


@needs_bf16
@pytest.mark.parametrize("op", ["linear", pytest.param("linear_tiles", marks=needs_amx)])
@pytest.mark.parametrize(("rows", "out_features", "in_features", "bias"), SHAPES)
def test_linear_matches_a_bfloat16_linear(op: str, rows: int, out_features: int, in_features: int, bias: bool) -> None:
    """Within one bfloat16 rounding of the fp32-accumulated product (what oneDNN's bf16 linear
    returns), on AVX512-BF16 and on AMX tiles (input sizes not a multiple of 32, such as 6 or
    16 here, run linear_tiles on the AVX512-BF16 path)."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    got = getattr(torch.ops.flare_native, op)(x, torch.ops.flare_native.pack_linear(w), b, out_features)
    exact = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-3)


@needs_bf16
def test_linear_keeps_leading_dims_and_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen).bfloat16()
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    packed = torch.ops.flare_native.pack_linear(w)
    together = torch.ops.flare_native.linear(x, packed, None, 48)
    assert together.shape == (2, 3, 48)
    alone = torch.ops.flare_native.linear(x[1, 2:3], packed, None, 48)
    assert torch.equal(alone[0], together[1, 2])  # a row's result does not depend on the batch


@needs_amx
def test_a_rows_tiles_result_does_not_depend_on_the_batch() -> None:
    """Fewer than 16 rows run on short tiles, more on padded 16-row tiles in pairs: the same row
    gets the same bits in a batch of 1, 5, 16, 17, 40 or 64 rows."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(100, 576, generator=gen).bfloat16()
    packed = torch.ops.flare_native.pack_linear(w)
    row = torch.randn(1, 576, generator=gen).bfloat16()
    alone = torch.ops.flare_native.linear_tiles(row, packed, None, 100)
    for rows in (5, 16, 17, 40, 64):
        batch = torch.randn(rows, 576, generator=gen).bfloat16()
        batch[rows - 1] = row[0]
        assert torch.equal(torch.ops.flare_native.linear_tiles(batch, packed, None, 100)[rows - 1], alone[0]), rows


@needs_bf16
def test_linear_refuses_what_it_cannot_compute() -> None:
    w = torch.randn(32, 16).bfloat16()
    odd = torch.ops.flare_native.pack_linear(torch.randn(32, 15).bfloat16())  # packed (linear_avx2 takes it)
    with pytest.raises(RuntimeError, match="even"):  # the pair dot product does not
        torch.ops.flare_native.linear(torch.randn(2, 15).bfloat16(), odd, None, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.flare_native.linear(torch.randn(2, 8).bfloat16(), torch.ops.flare_native.pack_linear(w), None, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.flare_native.linear(torch.randn(2, 16), torch.ops.flare_native.pack_linear(w), None, 32)


STEPS = {  # history lengths, queries per sequence (0: a sequence with none this step)
    "decode": ([20, 33, 5], [1, 1, 1]),
    "decode with an idle sequence": ([20, 1, 5], [1, 0, 1]),
    "mixed": ([20, 40, 7], [1, 4, 1]),
    "whole prompts": ([12, 5], [12, 5]),
    "drafts under verification": ([9, 30, 2], [3, 7, 1]),
}


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (8, 0.0), (0, 20.0), (3, 5.0)])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_ops_cpu_slot_computes_what_the_python_kernel_does(name, dtype, cache_dtype, window, softcap) -> None:
    """Once loaded, the library serves flare::paged_attention itself, every query row on one
    arithmetic per layer: each row of a chunk equals the same row attended alone as a decode row
    (docs/serving.md, "Reproducibility"), and all stay close to the reference op."""
    lens, queries = STEPS[name]
    gen = torch.Generator().manual_seed(len(name))
    page_tokens, heads, kv_heads, dim = 4, 6, 2, 64
    k_cache = torch.randn(80, page_tokens, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(80, page_tokens, kv_heads, dim, generator=gen).to(cache_dtype)
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(80, generator=gen)[: len(lens) * 12].view(len(lens), 12).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(lens, queries)]).long()
    args = (q, k_cache, v_cache, tables, seq_lens, starts, positions, 0.125, window, softcap)
    got = torch.ops.flare.paged_attention(*args)
    owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(queries))
    alone = torch.ops.flare.paged_attention(
        q,
        k_cache,
        v_cache,
        tables[owner].contiguous(),
        (positions + 1).int(),
        torch.arange(q.shape[0] + 1, dtype=torch.int32),
        positions,
        0.125,
        window,
        softcap,
    )
    assert torch.equal(got, alone)
    reference = reference_paged_attention(*args)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference.float(), rtol=tolerance, atol=tolerance)


def test_the_ops_write_kv_slot_is_the_native_copy() -> None:
    caches = [torch.zeros(6, 4, 2, 8) for _ in range(4)]
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([3, -1, 17])
    torch.ops.flare.write_kv(caches[0], caches[1], k, v, slots)
    reference_write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


bf16_chunks = pytest.mark.skipif(
    not native.load() or not torch.ops.flare_native.has_bf16_linear(), reason="the chunk kernel needs AVX512-BF16"
)


def _chunk_case(seed: int, dim: int, kv_len: int):
    gen = torch.Generator().manual_seed(seed)
    pages, page_tokens, heads, kv_heads = -(-kv_len // 16) + 2, 16, 9, 3
    k_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen).bfloat16()
    tables = torch.randperm(pages, generator=gen)[None, : pages - 2].int()
    q = torch.randn(kv_len, heads, dim, generator=gen).bfloat16()
    return q, k_cache, v_cache, tables


def _attend(q, k_cache, v_cache, tables, first: int, kv_len: int, window: int = 0):
    rows = q.shape[0]
    return torch.ops.flare.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor([kv_len], dtype=torch.int32),
        torch.tensor([0, rows], dtype=torch.int32),
        torch.arange(first, first + rows),
        0.125,
        window,
        0.0,
    )


@bf16_chunks
@pytest.mark.parametrize("dim,window", [(64, 0), (128, 0), (64, 40), (256, 0)])
def test_bf16_chunks_match_the_reference(dim: int, window: int) -> None:
    q, k_cache, v_cache, tables = _chunk_case(dim + window, dim, 200)
    for first, rows in ((0, 200), (150, 50), (199, 1 + 0), (60, 7)):
        got = _attend(q[first : first + rows], k_cache, v_cache, tables, first, first + rows, window)
        args = (
            q[first : first + rows].float(),
            k_cache.float(),
            v_cache.float(),
            tables,
            torch.tensor([first + rows], dtype=torch.int32),
            torch.tensor([0, rows], dtype=torch.int32),
            torch.arange(first, first + rows),
            0.125,
            window,
            0.0,
        )
        torch.testing.assert_close(got.float(), reference_paged_attention(*args), rtol=2e-2, atol=2e-2)


@bf16_chunks
def test_queries_cut_from_a_wider_projection_attend_as_contiguous_ones() -> None:
    """Queries that are a view into a fused projection's output (strided rows), as a decode step,
    a short chunk and a prompt chunk: the same bits as their contiguous copy, and a contiguous
    output."""
    q, k_cache, v_cache, tables = _chunk_case(11, 64, 300)
    fused = torch.cat([q.flatten(1), torch.zeros(300, 2 * 3 * 64, dtype=q.dtype)], dim=1)
    strided = fused[:, : 9 * 64].unflatten(1, (9, 64))
    assert not strided.is_contiguous()
    for first, rows in ((299, 1), (200, 4), (100, 40)):
        got = _attend(strided[first : first + rows], k_cache, v_cache, tables, first, first + rows)
        assert got.is_contiguous()
        assert torch.equal(got, _attend(q[first : first + rows], k_cache, v_cache, tables, first, first + rows))


@bf16_chunks
def test_a_rows_result_does_not_depend_on_its_chunk() -> None:
    """A prompt attended whole, in chunks, or after a cached prefix gives every row the same bits
    (chunked prefill and prefix reuse never change a 16-bit core's answer)."""
    q, k_cache, v_cache, tables = _chunk_case(3, 64, 300)
    whole = _attend(q, k_cache, v_cache, tables, 0, 300)
    for cuts in ((100,), (7, 200), (64, 128, 298), (13, 15, 17)):  # chunks of 2+ rows (one row is a decode row)
        edges = [0, *cuts, 300]
        parts = [_attend(q[a:b], k_cache, v_cache, tables, a, b) for a, b in zip(edges, edges[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts


@bf16_chunks
@pytest.mark.parametrize("window", [0, 40])
def test_short_chunks_beside_decode_rows_and_prompt_chunks_keep_every_bit(window: int) -> None:
    """One step holding a verification-sized chunk (a decode row and three drafts), a decode row,
    prompt chunks and short chunks on both sides of the in-place limit, all over the same pages: each
    row gets the bits it gets when its whole prompt is attended at once."""
    q, k_cache, v_cache, tables = _chunk_case(5, 64, 300)
    whole = _attend(q, k_cache, v_cache, tables, 0, 300, window)
    # [first, end) positions per sequence: 4, 1, 20, 2, 7, 8 and 9 rows (chunks of up to 8 rows are
    # attended where their pages lie, longer ones over their gathered pages)
    spans = [(100, 104), (250, 251), (150, 170), (298, 300), (200, 207), (60, 68), (30, 39)]
    got = attend_spans(q, k_cache, v_cache, tables.expand(len(spans), -1).contiguous(), spans, window)
    assert torch.equal(got, torch.cat([whole[a:b] for a, b in spans]))
