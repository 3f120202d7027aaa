"""Issue 43 for the families beyond DecoderProgram: MiniMax M3 (block-sparse attention, its Lightning
indexer), Kimi K3 (multi-head latent attention + MoE with a shared expert) and DeepSeek V4 (its
compressed and indexer caches, hyper-connections, grouped output). Each at 2 ranks, tensor parallel
and with the experts split 2/2 (gloo, one thread a rank, real processes): greedy tokens equal one
rank's and every logprob is within 1e-4 over 64-token answers (top-20, explicit ids, prompt
logprobs). CI runs MiniMax M3 with its experts split; the rest with FLARE_SLOW_TESTS=1.

In one process (CI): each family's shards put every weight back (split pieces concatenate to the
whole, shared pieces are replicated), the caches shared by all heads stay whole on every rank, and
sizes the family cannot split into are refused naming the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_tp_equivalence import _one_rank
from tp_support import SLOW, answers, assert_same_answers

from ignition import parallel, parallel_rules
from ignition.errors import UsageError
from ignition.export import ExportOptions, export_core, internal_weights, kv_layout
from ignition.models import family
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

CASES = [
    pytest.param("minimax_m3", "minimax_m3", True, {}, id="minimax_m3-experts"),
    pytest.param("minimax_m3", "minimax_m3", False, {}, id="minimax_m3-tensor", marks=SLOW),
    # one indexer head for 2 ranks: each rank computes the head all its query heads read
    pytest.param("minimax_m3", "minimax_m3", False, {"index_n_heads": 1}, id="minimax_m3-shared-index", marks=SLOW),
    pytest.param("kimi_k3", "kimi3", False, {}, id="kimi_k3-tensor", marks=SLOW),
    pytest.param("kimi_k3", "kimi3", True, {}, id="kimi_k3-experts", marks=SLOW),
    pytest.param("deepseek_v4", "deepseek4", False, {}, id="deepseek_v4-tensor", marks=SLOW),
    pytest.param("deepseek_v4", "deepseek4", True, {}, id="deepseek_v4-experts", marks=SLOW),
]


@pytest.mark.parametrize(("name", "recipe", "expert", "overrides"), CASES)
def test_two_ranks_answer_as_one(name: str, recipe: str, expert: bool, overrides: dict, tmp_path: Path) -> None:
    write_testmodel(name, tmp_path / "ckpt", seed=0, overrides=overrides)
    options = ExportOptions(out=tmp_path / "core", prompt_logprobs=True, tensor_parallel=(1, 2), expert_parallel=expert)
    export_core(open_source(str(tmp_path / "ckpt")), load_recipe(recipe), options)
    flags = ("--tensor-parallel", "2", *(("--expert-parallel",) if expert else ()))
    many = answers(tmp_path / "core", tmp_path / "tp2.json", *flags)
    assert_same_answers(_one_rank(tmp_path / "core"), many)


def _tiny(name: str, root: Path) -> tuple[object, object, dict[str, torch.Tensor]]:
    write_testmodel(name, root, seed=0)
    source = open_source(str(root))
    fam = family(name)
    config = fam.config_from_hf(source.hf_config)
    return fam, config, internal_weights(fam, source, config, torch.float32)


# (family, weights split along dim 0 / dim 1 across the ranks, weights every rank holds whole)
SPLITS = [
    (
        "minimax_m3",
        ("layers.0.wq", "layers.0.wk", "layers.0.idx_wq"),
        ("layers.0.wo", "layers.0.w_down"),
        ("layers.0.idx_wk",),
    ),
    (
        "kimi_k3",
        ("layers.1.wq_b", "layers.1.wkv_b"),
        ("layers.1.wo", "layers.1.w_shared_down"),
        ("layers.1.wq_a", "layers.1.wkv_a", "layers.1.kv_a_norm", "layers.1.w_router"),
    ),
    (
        "deepseek_v4",
        ("layers.1.wq_b", "layers.1.sinks", "layers.1.wo_a"),
        ("layers.1.wo_b", "layers.1.w_shared_down"),
        ("layers.1.wkv", "layers.1.index.wq_b", "layers.1.comp.w_kv_gate", "layers.1.tid2eid", "hc_head.fn"),
    ),
]


@pytest.mark.parametrize(("name", "column", "row", "replicated"), SPLITS)
def test_shards_put_every_weight_back(name: str, column: tuple, row: tuple, replicated: tuple, tmp_path: Path) -> None:
    fam, config, w = _tiny(name, tmp_path)
    for expert in (False, True):
        ranks = [parallel.shard(fam, config, w, r, 2, expert) for r in range(2)]
        for key in column:
            assert torch.equal(torch.cat([s[key] for s in ranks]), w[key]), key
        for key in row:
            assert torch.equal(torch.cat([s[key] for s in ranks], dim=1), w[key]), key
        assert all(torch.equal(s[key], w[key]) for s in ranks for key in replicated)
        moe = next(k for k in w if k.endswith("w_experts_down"))
        dim = 0 if expert else 2  # whole experts, or each expert's width
        assert torch.equal(torch.cat([s[moe] for s in ranks], dim=dim), w[moe])
        if expert:  # 8 experts: 4 a rank
            assert [int(s["expert_start"]) for s in ranks] == [0, 4]
        else:
            assert all("expert_start" not in s for s in ranks)
        assert sum(t.numel() for t in ranks[1].values()) < sum(t.numel() for t in w.values())


def test_caches_every_head_reads_stay_whole_on_each_rank(tmp_path: Path) -> None:
    """MLA's latent, MiniMax's indexer keys and V4's compressed and indexer caches: one row per token on
    every rank (computed whole there); MiniMax's KV heads split."""
    for name in ("kimi_k3", "minimax_m3", "deepseek_v4"):
        fam, config, _ = _tiny(name, tmp_path / name)
        whole, rank = (
            kv_layout(fam, config, "float32"),
            kv_layout(fam, parallel.sharded_config(fam, config, 2, False), "float32"),
        )
        assert rank.extra == whole.extra, name
        expected = whole.num_kv_heads // 2 if name == "minimax_m3" else whole.num_kv_heads
        assert (rank.num_kv_heads, rank.head_dim) == (expected, whole.head_dim), name


def test_more_ranks_than_indexer_heads_share_the_head_their_queries_read(tmp_path: Path) -> None:
    """MiniMax M3 with 2 indexer heads at 4 ranks: query heads 0-1 read indexer head 0, so ranks 0 and 1
    hold head 0 and ranks 2 and 3 head 1 (their traced config: one indexer head)."""
    fam, config, w = _tiny("minimax_m3", tmp_path)
    wide = dataclasses.replace(config, num_heads=8, num_kv_heads=4)
    heads = w["layers.0.idx_wq"].view(2, -1, w["layers.0.idx_wq"].shape[1])
    for rank, head in enumerate((0, 0, 1, 1)):
        part = parallel_rules.index_query(w["layers.0.idx_wq"], parallel_rules.Slice(wide, rank, 4, False))
        assert torch.equal(part, heads[head])
    assert parallel.sharded_config(fam, wide, 4, False).index_heads == 1


def test_sizes_a_family_cannot_split_are_refused(tmp_path: Path) -> None:
    fam, config, _ = _tiny("minimax_m3", tmp_path / "m")
    with pytest.raises(UsageError, match="--tensor-parallel 4: num_key_value_heads 2 is not divisible by 4"):
        parallel.check(fam, config, (1, 4), expert=False)
    widths = {"shared_intermediate_size": 48, "intermediate_size": 48}  # 6 ranks divide all but the indexer
    odd = dataclasses.replace(config, num_heads=12, num_kv_heads=6, index_heads=4, **widths)
    with pytest.raises(UsageError, match="index_n_heads 4 neither divides nor is divisible by 6"):
        parallel.check(fam, odd, (6,), expert=False)
    fam, config, _ = _tiny("deepseek_v4", tmp_path / "d")
    with pytest.raises(UsageError, match="--tensor-parallel 4: o_groups 2 is not divisible by 4"):
        parallel.check(fam, config, (4,), expert=False)
    with pytest.raises(UsageError, match="the glm5_next family cannot be exported for more than one rank yet"):
        parallel.check(family("glm5_next"), config, (2,), expert=False)
