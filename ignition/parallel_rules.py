"""Each family's tensor- and expert-parallel sharding rules (used by ignition.parallel).

A family's `Rules` say which sizes its config can be split into (the fields a size must divide, named
in the refusal), the config its rank program is traced with (heads and widths / N), and, by internal
weight name, how each weight is split: the first matching pattern wins and a weight no pattern names
is refused, so a new tensor never slips into a shard unsplit. The vocabulary rows of `embed` and
`lm_head` and the rank offsets are ignition.parallel's, the same for every family.

Attention splits by query heads everywhere. Where a piece is shared by all heads (MLA's latent and
rotary key, DeepSeek-V4's single key=value head and its compressors, MiniMax M3's indexer key, the
q LoRA down-projections) it is replicated: every rank computes it whole and holds its cache whole,
which is exact (vLLM's and SGLang's MLA layout). Per-head pieces (query up-projections, MLA's
per-head kv_b, V4's sinks and output groups, MiniMax's indexer query heads) are column-parallel and
the output projection row-parallel. MLPs, shared experts included, split by width; routed experts
by width or, under expert parallel, as whole experts; routers are replicated.

The DecoderProgram families (llama, qwen3, qwen3_moe) also split sizes that do not divide: heads by
whole KV-head groups, widths in uneven contiguous shares, each rank's share zero-padded to the largest
(`span`), so one rank program serves every rank (docs/parallel.md, "Uneven splits").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Slice:
    """Which rank's part of a weight is wanted, and of what config (for rules that need its sizes)."""

    config: Any
    rank: int
    n: int
    expert: bool


Split = Callable[[Tensor, Slice], Tensor]


def bounds(total: int, rank: int, n: int) -> tuple[int, int]:
    """The rank's contiguous [start, end) of `total` items split n ways as evenly as possible (sizes
    differ by at most one, the larger first: 3 on 2 ranks is 2 + 1); total / n each where n divides."""
    return -(-rank * total // n), -(-(rank + 1) * total // n)


def span(t: Tensor, start: int, end: int, size: int, dim: int) -> Tensor:
    """t[start:end] along `dim`, zero-padded to `size` there: every rank's piece has one shape, so one
    rank program serves them all. A padded row is exact: a zero query/key/value head attends to zeros
    and meets zero columns of wo; a zero gate/up row gives silu(0) * 0 = 0 into a zero column of down."""
    part = t.narrow(dim, start, end - start)
    if end - start == size:
        return part
    pad = list(part.shape)
    pad[dim] = size - (end - start)
    return torch.cat([part, part.new_zeros(pad)], dim=dim)


def rows(t: Tensor, rank: int, n: int, dim: int = 0) -> Tensor:
    """The rank's n-th of `t` along `dim` (contiguous; where n does not divide it, the rank's uneven
    share zero-padded to ceil(size / n))."""
    start, end = bounds(t.shape[dim], rank, n)
    return span(t, start, end, -(-t.shape[dim] // n), dim)


def halves(t: Tensor, rank: int, n: int, dim: int) -> Tensor:
    """A fused [gate; up] projection's rank slice: its share of each half, gate first."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([rows(gate, rank, n, dim), rows(up, rank, n, dim)], dim=dim)


def column(t: Tensor, s: Slice) -> Tensor:
    """Column-parallel (output rows split): per-head projections, sinks, V4's per-group o_a."""
    return rows(t, s.rank, s.n, 0)


def row(t: Tensor, s: Slice) -> Tensor:
    """Row-parallel (input columns split): output and down projections; the ranks' sums meet in all_reduce."""
    return rows(t, s.rank, s.n, 1)


def gate_up(t: Tensor, s: Slice) -> Tensor:
    return halves(t, s.rank, s.n, 0)


def whole(t: Tensor, s: Slice) -> Tensor:
    return t


def experts_gate_up(t: Tensor, s: Slice) -> Tensor:
    """[E, 2F, H]: whole experts under expert parallel, else each expert's share of gate and up."""
    return rows(t, s.rank, s.n) if s.expert else halves(t, s.rank, s.n, 1)


def experts_down(t: Tensor, s: Slice) -> Tensor:
    """[E, H, F]: whole experts under expert parallel, else each expert's share of its width."""
    return rows(t, s.rank, s.n) if s.expert else rows(t, s.rank, s.n, 2)


def kv_groups(c: Any, rank: int, n: int) -> tuple[int, int, int]:
    """GQA split by KV-head groups: the rank's KV heads [start, end) (with their query heads) and the
    KV heads every rank's program has, ceil(kv_heads / n) (9 heads / 3 KV heads on 2 ranks: rank 0 KV
    heads 0-1 and query heads 0-5, rank 1 KV head 2 and query heads 6-8, padded with one zero group)."""
    start, end = bounds(c.num_kv_heads, rank, n)
    return start, end, -(-c.num_kv_heads // n)


def fused_qkv(t: Tensor, s: Slice) -> Tensor:
    """DecoderProgram's fused [q; k; v]: the rank's query heads, then its KV heads of k and of v."""
    c = s.config
    q, k, v = t.split([c.num_heads * c.head_dim, c.kv_dim, c.kv_dim])
    start, end, per = kv_groups(c, s.rank, s.n)
    qd = c.num_heads // c.num_kv_heads * c.head_dim  # one KV group's query rows
    kd = c.head_dim
    parts = [span(q, start * qd, end * qd, per * qd, 0)]
    parts += [span(x, start * kd, end * kd, per * kd, 0) for x in (k, v)]
    return torch.cat(parts)


def heads_out(t: Tensor, s: Slice) -> Tensor:
    """DecoderProgram's wo, row-parallel by the rank's query heads (those of its KV groups)."""
    c = s.config
    start, end, per = kv_groups(c, s.rank, s.n)
    qd = c.num_heads // c.num_kv_heads * c.head_dim
    return span(t, start * qd, end * qd, per * qd, 1)


def index_query(t: Tensor, s: Slice) -> Tensor:
    """MiniMax M3's indexer query [index_heads * dim, hidden]: attention head h reads indexer head
    h // (heads / index_heads), so a rank holds the indexer heads its query heads read: its n-th of
    them, or (more ranks than indexer heads) the one head all its query heads share."""
    c = s.config
    if c.index_heads % s.n == 0:
        return rows(t, s.rank, s.n)
    head = s.rank * c.index_heads // s.n
    return t.narrow(0, head * c.index_head_dim, c.index_head_dim)


MLP = (
    (r"w_gate_up|w_shared_gate_up", gate_up),
    (r"w_down|w_shared_down", row),
    (r"w_experts_gate_up", experts_gate_up),
    (r"w_experts_down", experts_down),
    (r"w_router|router_bias|tid2eid", whole),
)
NORMS = (r"norm|attn_norm|mlp_norm|q_norm|k_norm", whole)


def _patterns(*entries: tuple[str, Split]) -> tuple[tuple[re.Pattern[str], Split], ...]:
    """Rules over a weight's name after its `layers.N.` prefix (the whole name for top-level ones)."""
    return tuple((re.compile(f"^(?:{pattern})$"), split) for pattern, split in entries)


def divisible(n: int, fields: dict[str, int]) -> str | None:
    """The first field `n` does not divide, as a refusal's words."""
    for field, value in fields.items():
        if value % n:
            return f"{field} {value} is not divisible by {n}"
    return None


@dataclass(frozen=True, slots=True)
class Rules:
    """One family's sharding: refusal(config, n, expert) -> why not (None: it splits), the traced rank
    config's changes, the number of routed experts (0: none), the weight rules, and the weights a rank
    program never reads (left out of every shard: MTP layers, whose drafters run at one rank only)."""

    refusal: Callable[[Any, int, bool], str | None]
    changes: Callable[[Any, int, bool], dict[str, Any]]
    experts: Callable[[Any], int]
    weights: tuple[tuple[re.Pattern[str], Split], ...]
    dropped: Callable[[Any, str], bool] = lambda config, name: False

    def rank_config(self, config: Any, n: int, expert: bool) -> Any:
        return dataclasses.replace(config, **self.changes(config, n, expert))

    def split(self, name: str, t: Tensor, s: Slice) -> Tensor | None:
        """The rank's part of weight `name`; None where no rule names it."""
        local = re.sub(r"^layers\.\d+\.", "", name)
        for pattern, split in self.weights:
            if pattern.match(local):
                return split(t, s)
        return None


# ---------------------------------------------------------------------- DecoderProgram families


def _decoder_refusal(c: Any, n: int, expert: bool) -> str | None:
    # Heads split by whole KV groups and widths by uneven shares (both zero-padded to one shape), so
    # only a size above the KV heads (their replication is not built) or whole experts must divide.
    if c.num_kv_heads < n:
        return (
            f"num_key_value_heads {c.num_kv_heads} is fewer than {n} ranks (each rank needs a KV head of its "
            f"own; KV-head replication is not built): use at most {c.num_kv_heads} ranks"
        )
    return divisible(n, {"num_experts": c.num_experts}) if expert and hasattr(c, "num_experts") else None


def _decoder_changes(c: Any, n: int, expert: bool) -> dict[str, Any]:
    per = -(-c.num_kv_heads // n)  # kv_groups: whole KV groups a rank, padded to the largest share
    changes = {"num_heads": per * (c.num_heads // c.num_kv_heads), "num_kv_heads": per}
    if hasattr(c, "intermediate_size"):
        changes["intermediate_size"] = -(-c.intermediate_size // n)
    if hasattr(c, "moe_intermediate_size") and not expert:
        changes["moe_intermediate_size"] = -(-c.moe_intermediate_size // n)
    return changes


DECODER = Rules(
    _decoder_refusal,
    _decoder_changes,
    lambda c: getattr(c, "num_experts", 0),
    _patterns(("wqkv", fused_qkv), (r"wo", heads_out), *MLP, NORMS),
)


# ---------------------------------------------------------------------- MiniMax M3


def _minimax_refusal(c: Any, n: int, expert: bool) -> str | None:
    fields = {"num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads}
    if not all(c.moe_layers):
        fields["dense_intermediate_size"] = c.dense_intermediate_size
    if any(c.moe_layers):
        fields["shared_intermediate_size"] = c.shared_intermediate_size
        fields.update(
            {"num_local_experts": c.router.num_experts} if expert else {"intermediate_size": c.intermediate_size}
        )
    why = divisible(n, fields)
    if why is None and any(c.sparse_layers) and c.index_heads % n and n % c.index_heads:
        why = f"index_n_heads {c.index_heads} neither divides nor is divisible by {n}"
    return why


def _minimax_changes(c: Any, n: int, expert: bool) -> dict[str, Any]:
    changes = {
        "num_heads": c.num_heads // n,
        "num_kv_heads": c.num_kv_heads // n,
        "dense_intermediate_size": c.dense_intermediate_size // n,
        "shared_intermediate_size": c.shared_intermediate_size // n,
        "index_heads": max(c.index_heads // n, 1),
    }
    if not expert:
        changes["intermediate_size"] = c.intermediate_size // n
    return changes


MINIMAX_M3 = Rules(
    _minimax_refusal,
    _minimax_changes,
    lambda c: c.router.num_experts,
    _patterns(
        (r"wq|wk|wv", column),
        (r"wo", row),
        ("idx_wq", index_query),
        (r"idx_wk|idx_q_norm|idx_k_norm", whole),  # the indexer key: one head every query head reads
        *MLP,
        NORMS,
    ),
)


# ---------------------------------------------------------------------- MLA: Kimi K3 / DeepSeek-V3


def _mla_refusal(c: Any, n: int, expert: bool) -> str | None:
    fields = {"num_attention_heads": c.num_heads}
    if c.first_k_dense_replace:
        fields["intermediate_size"] = c.intermediate_size
    if c.n_shared_experts:
        fields["shared expert width (n_shared_experts * moe_intermediate_size)"] = (
            c.n_shared_experts * c.moe_intermediate_size
        )
    fields.update(
        {"n_routed_experts": c.router.num_experts} if expert else {"moe_intermediate_size": c.moe_intermediate_size}
    )
    return divisible(n, fields)


def _mla_changes(c: Any, n: int, expert: bool) -> dict[str, Any]:
    changes = {"num_heads": c.num_heads // n, "intermediate_size": c.intermediate_size // n}
    if not expert:
        changes["moe_intermediate_size"] = c.moe_intermediate_size // n
    return changes


def _mtp_layer(c: Any, name: str) -> bool:
    match = re.match(r"^layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= c.num_layers


KIMI_K3 = Rules(
    _mla_refusal,
    _mla_changes,
    lambda c: c.router.num_experts,
    _patterns(
        # the q LoRA's down-projection and the latent (c_kv, k_pe) are every head's: computed whole
        (r"wq_a|q_a_norm|wkv_a|kv_a_norm", whole),
        (r"wq|wq_b|wkv_b", column),  # per-head rows: query, and kv_b's key and value up-projections
        (r"wo", row),
        *MLP,
        NORMS,
    ),
    dropped=_mtp_layer,
)


# ---------------------------------------------------------------------- DeepSeek-V4


def _v4_refusal(c: Any, n: int, expert: bool) -> str | None:
    fields = {
        "num_attention_heads": c.num_heads,
        "o_groups": c.o_groups,
        "moe_intermediate_size (shared expert)": c.moe_intermediate_size,
    }
    if expert:
        fields["n_routed_experts"] = c.router.num_experts
    return divisible(n, fields)


def _v4_changes(c: Any, n: int, expert: bool) -> dict[str, Any]:
    # The shared expert is moe_intermediate_size wide too: the program reads widths from the weights,
    # so under expert parallel the routed experts stay whole while the shared one is split.
    changes = {"num_heads": c.num_heads // n, "o_groups": c.o_groups // n}
    if not expert:
        changes["moe_intermediate_size"] = c.moe_intermediate_size // n
    return changes


DEEPSEEK_V4 = Rules(
    _v4_refusal,
    _v4_changes,
    lambda c: c.router.num_experts,
    _patterns(
        (r"wq_b|sinks|wo_a", column),  # the rank's query heads, their sinks and their output groups
        (r"wo_b", row),
        # one key=value head, its compressors and the indexer (its heads meet in one top-k): whole
        (r"wq_a|q_a_norm|wkv|kv_norm|(comp|index)\..*", whole),
        (r"(attn_hc|ffn_hc|hc_head)\.(fn|base|scale)", whole),
        *MLP,
        NORMS,
    ),
    dropped=_mtp_layer,
)

RULES: dict[str, Rules] = {
    "llama": DECODER,
    "qwen3": DECODER,
    "qwen3_moe": DECODER,
    "minimax_m3": MINIMAX_M3,
    "kimi_k3": KIMI_K3,
    "deepseek_v4": DEEPSEEK_V4,
}
