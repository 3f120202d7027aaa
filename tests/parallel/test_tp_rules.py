"""Issue 43, in one process: the collectives' one-rank identity and their refusal without a group,
the sharding rules (every rank's shard puts the whole tensor back), refusals at export (a family
without rules, a size that does not divide) and at serve time (an undeclared size, expert mode)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tp_support import tp_llama_core

from helios.core import Core
from helios.core.ops import catalog
from helios.core.ops.collectives import CollectiveError
from helios.engine.parallel.world import WorldError, rank_core
from ignition import parallel
from ignition.errors import UsageError
from ignition.models import family
from ignition.models.common import DenseConfig

__all__ = ["tp_llama_core"]  # session fixture

CONFIG = DenseConfig(
    vocab_size=301,
    hidden_size=8,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    intermediate_size=6,
)


def test_collectives_are_the_identity_on_one_rank_and_refuse_without_a_group() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(torch.ops.flare.all_reduce(x, 1, "tp"), x)
    assert torch.equal(torch.ops.flare.all_gather(x, 1, 1, "tp"), x)
    with pytest.raises(CollectiveError, match="exported for 2 ranks"):
        torch.ops.flare.all_reduce(x, 2, "nowhere")
    assert {"all_reduce", "all_gather"} <= set(catalog.OPS) and catalog.OPS_VERSION >= 2


def test_an_op_set_this_helios_lacks_is_refused() -> None:
    assert catalog.problem("flare", catalog.OPS_VERSION, tuple(catalog.OPS)) is None
    why = catalog.problem("flare", catalog.OPS_VERSION + 1, ("write_kv", "all_to_all"))
    assert why is not None and "all_to_all" in why and "upgrade Flare" in why


def _weights(c: DenseConfig = CONFIG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "embed": (c.vocab_size, c.hidden_size),
        "lm_head": (c.vocab_size, c.hidden_size),
        "norm": (c.hidden_size,),
        "layers.0.attn_norm": (c.hidden_size,),
        "layers.0.mlp_norm": (c.hidden_size,),
        "layers.0.wqkv": (q + 2 * kv, c.hidden_size),
        "layers.0.wo": (c.hidden_size, q),
        "layers.0.w_gate_up": (2 * c.intermediate_size, c.hidden_size),
        "layers.0.w_down": (c.hidden_size, c.intermediate_size),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_shards_put_every_tensor_back() -> None:
    w, c = _weights(), CONFIG
    ranks = [parallel.shard(family("llama"), c, w, r, 2, expert=False) for r in range(2)]
    assert [int(s["vocab_start"]) for s in ranks] == [0, 151]
    assert torch.equal(torch.cat([s["embed"] for s in ranks])[: c.vocab_size], w["embed"])  # last rank padded
    assert torch.equal(torch.cat([s["layers.0.wo"] for s in ranks], dim=1), w["layers.0.wo"])
    assert torch.equal(torch.cat([s["layers.0.w_down"] for s in ranks], dim=1), w["layers.0.w_down"])
    halves = [s["layers.0.wqkv"].split([4, 2, 2]) for s in ranks]  # each rank: its q, k and v heads
    for part, whole in enumerate(w["layers.0.wqkv"].split([8, 4, 4])):
        assert torch.equal(torch.cat([h[part] for h in halves]), whole)
    gate, up = w["layers.0.w_gate_up"].chunk(2)
    split = [s["layers.0.w_gate_up"].chunk(2) for s in ranks]
    assert torch.equal(torch.cat([g for g, _ in split]), gate) and torch.equal(torch.cat([u for _, u in split]), up)
    assert all(torch.equal(s["norm"], w["norm"]) for s in ranks)
    with pytest.raises(UsageError, match="no sharding rule for weight 'layers.0.mystery' \\(llama\\)"):
        parallel.shard(family("llama"), c, {**w, "layers.0.mystery": torch.zeros(2)}, 0, 2, expert=False)


def test_uneven_heads_split_by_kv_groups_and_pad_with_zeros() -> None:
    """SmolLM2's 9 query / 3 KV heads (and an odd MLP width) on 2 ranks: rank 0 KV heads 0-1 with query
    heads 0-5, rank 1 KV head 2 with query heads 6-8 and a zero group; MLP 4 + 3 columns, padded to 4.
    Every rank's program has one shape (6 query, 2 KV heads, width 4)."""
    c = dataclasses.replace(CONFIG, num_heads=9, num_kv_heads=3, intermediate_size=7)
    w = _weights(c)
    fam = family("llama")
    parallel.check(fam, c, (1, 2, 3), expert=False)
    rank_config = parallel.sharded_config(fam, c, 2, expert=False)
    assert (rank_config.num_heads, rank_config.num_kv_heads, rank_config.intermediate_size) == (6, 2, 4)
    ranks = [parallel.shard(fam, c, w, r, 2, expert=False) for r in range(2)]
    q, k, v = w["layers.0.wqkv"].split([18, 6, 6])  # head_dim 2: query heads of 2 rows, 6 a KV group
    zero = torch.zeros(6, c.hidden_size)
    assert all(s["layers.0.wqkv"].shape == (12 + 4 + 4, c.hidden_size) for s in ranks)
    q0, k0, v0 = ranks[0]["layers.0.wqkv"].split([12, 4, 4])
    q1, k1, v1 = ranks[1]["layers.0.wqkv"].split([12, 4, 4])
    assert torch.equal(q0, q[:12]) and torch.equal(k0, k[:4]) and torch.equal(v0, v[:4])
    assert torch.equal(q1, torch.cat([q[12:], zero])) and torch.equal(k1, torch.cat([k[4:], zero[:2]]))
    assert torch.equal(v1, torch.cat([v[4:], zero[:2]]))
    wo = w["layers.0.wo"]
    assert torch.equal(ranks[0]["layers.0.wo"], wo[:, :12])
    assert torch.equal(ranks[1]["layers.0.wo"], torch.cat([wo[:, 12:], torch.zeros(c.hidden_size, 6)], dim=1))
    down = w["layers.0.w_down"]
    assert torch.equal(torch.cat([s["layers.0.w_down"] for s in ranks], dim=1)[:, :7], down)
    assert not ranks[1]["layers.0.w_down"][:, 3].any()
    gate, up = w["layers.0.w_gate_up"].chunk(2)
    split = [s["layers.0.w_gate_up"].chunk(2) for s in ranks]
    assert torch.equal(torch.cat([g for g, _ in split])[:7], gate) and torch.equal(
        torch.cat([u for _, u in split])[:7], up
    )
    # 3 ranks: one KV group each, no padding
    assert parallel.sharded_config(fam, c, 3, expert=False).num_kv_heads == 1


def test_export_refuses_families_and_sizes_it_cannot_split() -> None:
    with pytest.raises(UsageError, match="the gemma3 family cannot be exported for more than one rank yet"):
        parallel.check(family("gemma3"), CONFIG, (1, 2), expert=False)
    with pytest.raises(UsageError, match="--tensor-parallel 4: num_key_value_heads 2 is fewer than 4 ranks"):
        parallel.check(family("llama"), CONFIG, (1, 4), expert=False)
    with pytest.raises(UsageError, match="has no experts"):
        parallel.check(family("llama"), CONFIG, (2,), expert=True)
    parallel.check(family("llama"), CONFIG, (1, 2), expert=False)
    assert parallel.parse_sizes("1,2,4") == (1, 2, 4)
    with pytest.raises(UsageError):
        parallel.parse_sizes("1,two")


def test_serving_refuses_an_undeclared_size(tp_llama_core: Path) -> None:
    core = Core.open(tp_llama_core)
    assert core.manifest.parallel.tensor == (1, 2) and core.manifest.format.version >= 2  # the parallel record's
    with pytest.raises(WorldError, match=r"declares tensor-parallel sizes 1, 2; re-export .* --tensor-parallel 1,2,4"):
        rank_core(core, 4, 0, expert=False)
    with pytest.raises(WorldError, match="exported without --expert-parallel: serve it without --expert-parallel"):
        rank_core(core, 2, 0, expert=True)
    rank = rank_core(core, 2, 1, expert=False)
    assert (core.manifest.kv.num_kv_heads, rank.manifest.kv.num_kv_heads) == (3, 2)  # KV groups 2 + 1, padded
    assert rank.manifest.weights.file == "weights.tp2.rank1.safetensors"
