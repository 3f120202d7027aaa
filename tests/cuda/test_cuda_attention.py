"""helios' Triton attention kernels (helios.engine.cuda.attention) under Triton's interpreter, against
the core's reference kernels on random scattered pages: decode rows, prefill/verification chunks,
ragged lengths over page boundaries, padding rows, GQA, windows, soft-capping, sinks, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops.base import reference_paged_attention, reference_write_kv
from helios.core.ops.bidirectional import reference_paged_attention_until
from helios.core.ops.sinks import sink_attention
from helios.engine.cuda import attention
from tests.cuda.paged_steps import assert_close, captured, paged_step, reference

SCALE = 0.3
# (history lengths, queries per sequence, page_tokens, heads, kv heads, head_dim, window, softcap)
CASES = {
    "decode, MHA": ([5, 17, 1, 40], [1, 1, 1, 1], 4, 2, 2, 16, 0, 0.0),
    "decode, GQA 3, odd dim, padding row": ([9, 0, 33], [1, 1, 1], 8, 6, 2, 12, 0, 0.0),
    "decode, window < page": ([5, 37, 1, 32], [1, 1, 1, 1], 8, 4, 1, 16, 3, 0.0),
    "decode, window > tile, capped": ([70, 12], [1, 1], 4, 4, 2, 16, 35, 2.0),
    "prefill chunks after history, GQA 8": ([12, 45], [12, 9], 4, 8, 1, 16, 0, 0.0),
    "whole prompts, window, GQA 4": ([21, 9], [21, 9], 8, 4, 1, 8, 6, 0.0),
    "mixed decode and chunks, GQA 3": ([9, 3, 20, 0, 26], [1, 3, 1, 1, 10], 4, 6, 2, 16, 0, 0.0),
    "mixed, window and cap, odd page": ([9, 3, 20, 7, 26], [1, 3, 1, 7, 10], 5, 4, 2, 20, 6, 3.0),
}


def _case(name: str, dtype: torch.dtype = torch.float32):
    lens, queries, page_tokens, heads, kv_heads, dim, window, softcap = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    step = paged_step(gen, lens, queries, page_tokens)
    k_cache = torch.randn(step.num_pages, page_tokens, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(step.num_pages, page_tokens, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(step.positions.shape[0], heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start_loc, step.positions)
    return args, window, softcap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_paged_attention_matches_the_reference(name: str, dtype: torch.dtype) -> None:
    args, window, softcap = _case(name, dtype)
    got = captured(attention.paged_attention, *args, SCALE, window, softcap)
    assert_close(got, reference_paged_attention(*args, SCALE, window, softcap), dtype)
    assert got.dtype == dtype


def test_decode_bucket_padded_with_scratch_rows() -> None:
    """A captured decode bucket's padding rows (helios.engine.graphs): position 0, length 1, a block
    table naming only the scratch page (page 0 here, which paged_step never hands out)."""
    (q, k_cache, v_cache, tables, lens, starts, positions), _, _ = _case("decode, MHA")
    pad = 3
    tables = torch.cat([tables, torch.zeros(pad, tables.shape[1], dtype=torch.int32)])
    lens = torch.cat([lens, torch.ones(pad, dtype=torch.int32)])
    starts = torch.arange(starts.shape[0] + pad, dtype=torch.int32)
    positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int64)])
    q = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    args = (q, k_cache, v_cache, tables, lens, starts, positions)
    assert_close(captured(attention.paged_attention, *args, SCALE), reference_paged_attention(*args, SCALE), q.dtype)


def test_the_guard_refuses_host_reads() -> None:
    """The references read lengths on the host (uncapturable): the guard every test uses must say so."""
    args, _, _ = _case("decode, MHA")
    with pytest.raises(AssertionError, match="host read"):
        captured(reference_paged_attention, *args, SCALE)
    with pytest.raises(AssertionError, match="host read"):
        captured(lambda t: int(t[0]), args[4])


def test_bf16_cache_under_fp32_queries() -> None:
    """The reference casts the cache to the queries' dtype: fp32 queries over a bf16 pool stay tight."""
    (q, k_cache, v_cache, *rest), window, softcap = _case("mixed, window and cap, odd page")
    args = (q, k_cache.bfloat16(), v_cache.bfloat16(), *rest)
    got = captured(attention.paged_attention, *args, SCALE, window, softcap)
    assert_close(got, reference_paged_attention(*args, SCALE, window, softcap), torch.float32)


@pytest.mark.parametrize("name", ["mixed decode and chunks, GQA 3", "whole prompts, window, GQA 4"])
def test_paged_attention_until_sees_keys_after_the_query(name: str) -> None:
    """Image tokens see the whole image: until[t] past positions[t] for some rows of each chunk."""
    args, window, softcap = _case(name)
    positions, seq_lens, starts = args[6], args[4], args[5]
    until = positions.clone()
    for seq in range(seq_lens.shape[0]):  # an "image" over the middle of each sequence's queries
        start, end = int(starts[seq]), int(starts[seq + 1])
        if end - start >= 3:
            image = slice(start + 1, end - 1)
            until[image] = positions[end - 2]
    got = captured(attention.paged_attention_until, *args, until, SCALE, window, softcap)
    expected = reference_paged_attention_until(*args, until, SCALE, window, softcap)
    assert_close(got, expected, torch.float32)
    assert not torch.equal(until, positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no sinks"])
@pytest.mark.parametrize("name", ["mixed, window and cap, odd page", "decode, GQA 3, odd dim, padding row"])
def test_sink_attention_matches_the_reference(name: str, with_sinks: bool, dtype: torch.dtype) -> None:
    """Packed key|value rows with values narrower than keys (MiMo: 192 | 128), sinks per query head."""
    (q, k_cache, v_cache, *rest), window, _ = _case(name, dtype)
    packed = torch.cat([k_cache, v_cache[..., : k_cache.shape[-1] * 2 // 3]], dim=-1)
    gen = torch.Generator().manual_seed(5)
    sinks = torch.randn(q.shape[1], generator=gen) * 2 if with_sinks else None
    args = (q, packed, *rest, SCALE, window, sinks)
    got = captured(attention.sink_attention, *args)
    assert_close(got, reference(sink_attention)(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_stores_slots_and_skips_padding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    pages, page_tokens, kv_heads, dim = 6, 4, 3, 12
    k_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pages, page_tokens, kv_heads, dim, generator=gen).to(dtype)
    k = torch.randn(8, kv_heads, dim, generator=gen)
    v = torch.randn(8, kv_heads, dim, generator=gen)
    # Across pages, padding rows (negative), the last slot; graph padding rows write the scratch
    # slot 0, several of them the same (equal) rows.
    slots = torch.tensor([5, -1, 0, 23, 8, -1, 13, 0])
    k[7], v[7] = k[2], v[2]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(expected_k, expected_v, k, v, slots)
    captured(attention.write_kv, k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


class _Recorder:
    """Stands in for a torch.library.Library: records which ops get a kernel for which key."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def impl(self, name: str, fn: object, key: str) -> None:
        self.calls.append((name, key))


def test_kernels_are_registered_for_cuda() -> None:
    library = _Recorder()
    attention.register(library)  # type: ignore[arg-type]
    assert library.calls == [
        (name, "CUDA") for name in ("write_kv", "paged_attention", "paged_attention_until", "sink_attention")
    ]
