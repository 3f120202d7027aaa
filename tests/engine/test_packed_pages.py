"""Packed KV pages (helios/engine/native/packed_pages.cpp): the tile kernel's kept copies of full
bfloat16 pages give every row the bits it gets when its pages are packed afresh, and a page
written again (write_kv, or a write announced with forget_packed) is read as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import attend_spans

from helios.core import Core
from helios.engine import EngineConfig, build_engine, native
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from helios.engine.speculation.drafter import SpeculationConfig
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

pytestmark = pytest.mark.skipif(
    native._compiler() is None or not native.load() or not torch.ops.flare_native.has_bf16_linear(),
    reason="packed pages are kept by the AVX512-BF16 tile kernel",
)

HEADS, KV_HEADS, DIM = 9, 3, 64


def _caches(seed: int, pages: int, page_tokens: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(pages, page_tokens, KV_HEADS, DIM, generator=gen).bfloat16()
    return k, torch.randn(pages, page_tokens, KV_HEADS, DIM, generator=gen).bfloat16()


def _case(seed: int, page_tokens: int):
    """Two sequences of up to 300 keys over shuffled pages, sharing their first three pages (a
    cached prefix), and queries for every position."""
    per = -(-300 // page_tokens)
    k, v = _caches(seed, 2 * per + 2, page_tokens)
    gen = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(2 * per + 2, generator=gen)
    first, second = order[:per], torch.cat([order[:3], order[per : 2 * per - 3]])
    tables = torch.stack([first, second]).int()
    q = torch.randn(300, HEADS, DIM, generator=gen).bfloat16()
    return q, k, v, tables


@pytest.mark.parametrize("page_tokens,window", [(16, 0), (16, 40), (32, 0), (64, 0)])
def test_kept_pages_give_the_bits_of_pages_packed_afresh(page_tokens: int, window: int) -> None:
    q, k, v, tables = _case(page_tokens + window, page_tokens)
    kept_k, kept_v = k.clone(), v.clone()
    assert native.keep_packed([kept_k, kept_v]) == 1
    steps = [  # decode rows, short chunks (drafts under verification), a prompt chunk; both sequences
        [(299, 300), (130, 131)],
        [(250, 254), (199, 200)],
        [(100, 120), (60, 68)],
        [(31, 32), (295, 300)],
    ]
    for spans in steps * 2:  # the second round reads the copies the first one made
        table = torch.stack([tables[i % 2] for i in range(len(spans))]).contiguous()
        assert torch.equal(
            attend_spans(q, kept_k, kept_v, table, spans, window), attend_spans(q, k, v, table, spans, window)
        ), spans


def test_a_page_written_again_is_read_as_written() -> None:
    q, k, v, tables = _case(7, 16)
    kept_k, kept_v = k.clone(), v.clone()
    native.keep_packed([kept_k, kept_v])
    table, spans = tables[:1].contiguous(), [(299, 300)]
    assert torch.equal(attend_spans(q, kept_k, kept_v, table, spans), attend_spans(q, k, v, table, spans))
    # through write_kv (a draft rejected and its positions written again): keys 40-49, in a full page
    gen = torch.Generator().manual_seed(3)
    new_k, new_v = torch.randn(10, KV_HEADS, DIM, generator=gen), torch.randn(10, KV_HEADS, DIM, generator=gen)
    slots = torch.tensor([int(table[0, p // 16]) * 16 + p % 16 for p in range(40, 50)])
    for kc, vc in ((k, v), (kept_k, kept_v)):
        torch.ops.flare.write_kv(kc, vc, new_k, new_v, slots)
    assert torch.equal(attend_spans(q, kept_k, kept_v, table, spans), attend_spans(q, k, v, table, spans))
    # a whole page filled some other way (a host-store restore, a copied page), then announced
    page = table[0, 5:6].long()
    for kc, vc in ((k, v), (kept_k, kept_v)):
        kc.index_copy_(0, page, kc[table[0, 6:7].long()])
        vc.index_copy_(0, page, vc[table[0, 6:7].long()])
    native.forget_packed([kept_k], page)
    assert torch.equal(attend_spans(q, kept_k, kept_v, table, spans), attend_spans(q, k, v, table, spans))


def test_a_cache_freed_and_its_memory_reused_is_not_read_from_an_old_copy() -> None:
    q, k, v, tables = _case(9, 16)
    table, spans = tables[:1].contiguous(), [(299, 300)]
    kept_k, kept_v = k.clone(), v.clone()
    native.keep_packed([kept_k, kept_v])
    attend_spans(q, kept_k, kept_v, table, spans)
    del kept_k, kept_v
    other_k, other_v = _caches(10, k.shape[0])
    # whether or not the allocator hands back the same memory, nothing packed for the old cache is used
    assert torch.equal(
        attend_spans(q, other_k, other_v, table, spans), attend_spans(q, other_k.clone(), other_v.clone(), table, spans)
    )


def test_only_layouts_the_tile_kernel_reads_are_kept() -> None:
    k, v = _caches(1, 4)
    assert native.keep_packed([k.float(), v.float()]) == 0  # fp32 caches
    assert native.keep_packed(list(_caches(1, 4, page_tokens=8))) == 0  # pages of fewer than 16 keys
    odd = torch.zeros(4, 16, 2, 80, dtype=torch.bfloat16)
    assert native.keep_packed([odd, odd.clone()]) == 0  # head size not a multiple of 64
    assert native.keep_packed([k, v]) == 1


@pytest.fixture(scope="module")
def head64_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny bfloat16 Llama with 64-feature heads (what the tile kernel reads)."""
    root = tmp_path_factory.mktemp("packed")
    overrides = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
    checkpoint = write_testmodel("llama", root / "ckpt", seed=3, overrides=overrides)
    export_core(
        open_source(str(checkpoint)), load_recipe("smollm2"), ExportOptions(out=root / "core", dtype="bfloat16")
    )
    return root / "core"


def _answers(core: Path, packed: bool) -> tuple[dict[str, tuple[list[int], list[float]]], int]:
    engine = build_engine(
        Core.open(core),
        EngineConfig(num_pages=96, packed_kv_pages=packed, speculation=SpeculationConfig(mode="fixed")),
    )
    prefix = tuple(range(3, 83))  # five full pages shared through the prefix cache
    requests = [
        EngineRequest(
            f"r{i}", prefix + tuple(range(90 + i, 100 + 2 * i)), (GREEDY,), 60, ignore_eos=True, num_top_logprobs=0
        )
        for i in range(4)
    ]
    out = run_to_completion(engine, requests[:2])  # then the others, reusing their cached pages
    out |= run_to_completion(engine, requests[2:])
    answers = {rid: (o[0].token_ids, [e.logprob for e in o[0].logprobs]) for rid, o in out.items()}
    return answers, engine.executor.kept_pairs


def test_served_answers_are_the_same_with_kept_pages(head64_core: Path) -> None:
    """Greedy answers and logprobs over shared prefixes, decode rows and drafts under verification,
    the same bits with packed pages kept and without."""
    kept, pairs = _answers(head64_core, True)
    plain, none = _answers(head64_core, False)
    assert pairs > 0 and none == 0
    assert kept == plain
