"""Tensor- and expert-parallel rank programs and weight shards (`ignition export --tensor-parallel`).

For each declared size N > 1 the exporter traces the step program(s) with the sharded config
(heads, kv heads and MLP width / N; experts / N with expert parallel; the vocabulary in ceil(V / N)
rows a rank, the last padded) and `tp = N`, so the program
calls flare::all_reduce after its row-parallel projections and its vocabulary-parallel embedding,
and flare::all_gather on its vocabulary-parallel head's logits (ignition.models.step.StepModule).
One program per kind serves every rank: a rank's offsets (`vocab_start`, `expert_start`) are [1]
int64 weights in its shard. docs/parallel.md describes the layout; docs/core-format.md the manifest.

The sharding rules below cover the families whose step is `DecoderProgram` with a dense SwiGLU or
a routed MoE MLP (llama, qwen3, qwen3_moe); every other family is refused with the missing piece.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from helios.core import manifest as mf
from ignition.errors import UsageError
from ignition.models.family import Family

# family -> sharded here (None) or what is missing for it (the refusal names it; docs/parallel.md lists them)
SUPPORTED = ("llama", "qwen3", "qwen3_moe")
MISSING = {
    "kimi_k3": "multi-head latent attention sharding (MLA heads and the latent cache per rank)",
    "deepseek_v4": "multi-head latent attention sharding and its compressed and indexer caches per rank",
    "glm_moe_dsa": "multi-head latent attention and DeepSeek Sparse Attention indexer sharding",
    "minimax_m3": "block-sparse attention and Lightning-indexer cache sharding",
    "qwen3_next": "recurrent-state (gated delta rule) sharding",
    "nemotron_h": "recurrent-state (Mamba-2) sharding",
    "glm5_next": "recurrent-state (KDA) and k-pool indexer sharding",
    "gemma3": "sliding-window and softcapped head sharding rules",
    "gemma4": "per-layer embeddings, shared KV and vision sharding rules",
    "muse_spark": "its attention, shared experts and vision sharding rules",
    "step5": "its attention, MoE and vision sharding rules",
    "mimo_v2": "sink attention and MTP program sharding",
}
MOE = ("qwen3_moe",)

ExportProgram = Callable[..., mf.ProgramSpec]


def check(fam: Family, config: object, sizes: tuple[int, ...], expert: bool) -> None:
    """Refuse sizes the family or config cannot be split into, naming the size and the piece."""
    wanted = [n for n in sizes if n > 1]
    if not wanted:
        if expert:
            raise UsageError("--expert-parallel needs a --tensor-parallel size above 1")
        return
    if fam.name not in SUPPORTED:
        missing = MISSING.get(fam.name, "its step program's sharding rules (only DecoderProgram families have them)")
        raise UsageError(
            f"--tensor-parallel {','.join(map(str, sizes))}: the {fam.name} family cannot be exported for "
            f"more than one rank yet: missing {missing} (docs/parallel.md)"
        )
    if expert and fam.name not in MOE:
        raise UsageError(f"--expert-parallel: the {fam.name} family has no experts")
    if fam.vision_of(config) is not None:
        raise UsageError(f"--tensor-parallel: vision cores ({fam.name}) are not split across ranks yet")
    for n in wanted:
        for field, value in _divided(config, expert).items():
            if value % n:
                raise UsageError(f"--tensor-parallel {n}: {field} {value} is not divisible by {n}")


def _divided(config: object, expert: bool) -> dict[str, int]:
    """The config fields a size must divide."""
    c = config
    fields = {
        "num_attention_heads": c.num_heads,  # type: ignore[attr-defined]
        "num_key_value_heads": c.num_kv_heads,  # type: ignore[attr-defined]
    }
    if hasattr(c, "intermediate_size"):
        fields["intermediate_size"] = c.intermediate_size
    if hasattr(c, "num_experts"):
        fields["num_experts" if expert else "moe_intermediate_size"] = (
            c.num_experts if expert else c.moe_intermediate_size
        )
    return fields


def sharded_config(config: object, n: int, expert: bool) -> object:
    """The config a rank program is traced with: heads, kv heads and MLP widths / n (experts stay
    whole under expert parallel; the router always sees every expert)."""
    c = config
    changes = {"num_heads": c.num_heads // n, "num_kv_heads": c.num_kv_heads // n}  # type: ignore[attr-defined]
    if hasattr(c, "intermediate_size"):
        changes["intermediate_size"] = c.intermediate_size // n
    if hasattr(c, "moe_intermediate_size") and not expert:
        changes["moe_intermediate_size"] = c.moe_intermediate_size // n
    return dataclasses.replace(c, **changes)  # type: ignore[type-var]


def _rows(t: torch.Tensor, rank: int, n: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // n
    return t.narrow(dim, rank * size, size)


def _halves(t: torch.Tensor, rank: int, n: int, dim: int) -> torch.Tensor:
    """A fused [gate; up] projection's rank slice: its share of each half, gate first."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([_rows(gate, rank, n, dim), _rows(up, rank, n, dim)], dim=dim)


def _vocab_rows(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """A rank's ceil(V / n) vocabulary rows; the last rank's padded with zero rows (a padded row is
    never looked up, and its logit is cut after the gather: StepModule.gather_vocab)."""
    size = -(-t.shape[0] // n)
    part = t[rank * size : (rank + 1) * size]
    if part.shape[0] == size:
        return part
    return torch.cat([part, part.new_zeros(size - part.shape[0], *t.shape[1:])])


REPLICATED = re.compile(r"(^|\.)(norm|attn_norm|mlp_norm|q_norm|k_norm|w_router)$")


def shard(config: object, weights: dict[str, torch.Tensor], rank: int, n: int, expert: bool) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights of n: column-parallel wqkv (its q, k and v heads) and w_gate_up, row-parallel
    wo and w_down, vocabulary rows of embed and lm_head, experts split by width (or whole experts
    under expert parallel); norms and the router replicated. Any other tensor has no rule: refused."""
    c = config
    q_dim = c.num_heads * c.head_dim  # type: ignore[attr-defined]
    kv_dim = c.num_kv_heads * c.head_dim  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        base = name.rsplit(".", 1)[-1]
        if name in ("embed", "lm_head"):
            out[name] = _vocab_rows(t, rank, n)
        elif base == "wqkv":
            q, k, v = t.split([q_dim, kv_dim, kv_dim])
            out[name] = torch.cat([_rows(q, rank, n), _rows(k, rank, n), _rows(v, rank, n)])
        elif base == "wo" or base == "w_down":
            out[name] = _rows(t, rank, n, 1)
        elif base == "w_gate_up":
            out[name] = _halves(t, rank, n, 0)
        elif base == "w_experts_gate_up":
            out[name] = _rows(t, rank, n) if expert else _halves(t, rank, n, 1)
        elif base == "w_experts_down":
            out[name] = _rows(t, rank, n) if expert else _rows(t, rank, n, 2)
        elif REPLICATED.search(name):
            out[name] = t
        else:
            raise UsageError(f"--tensor-parallel: no sharding rule for weight {name!r}")
        out[name] = out[name].contiguous()
    vocab = -(-weights["embed"].shape[0] // n)
    out["vocab_start"] = torch.tensor([rank * vocab], dtype=torch.int64)
    if expert:
        experts = c.num_experts // n  # type: ignore[attr-defined]
        out["expert_start"] = torch.tensor([rank * experts], dtype=torch.int64)
    return dict(sorted(out.items()))


def export_ranks(
    fam: Family,
    config: object,
    sizes: tuple[int, ...],
    expert: bool,
    kinds: list[str],
    weights: dict[str, torch.Tensor],
    kv_of: Callable[[object], mf.KvLayout],
    dtype: str,
    staging: Path,
    export_program: ExportProgram,
) -> mf.Parallel:
    """Trace each size's rank programs and write every rank's shard under `staging`; the manifest's
    `parallel` record. export_program(config, kind, weights, kv, path, tp) traces one program."""
    layouts: dict[str, mf.ParallelLayout] = {}
    for n in sorted(set(sizes) - {1}):
        rank_config = sharded_config(config, n, expert)
        kv = kv_of(rank_config)
        first = shard(config, weights, 0, n, expert)
        programs = {
            kind: export_program(rank_config, kind, first, kv, staging / "programs" / f"{kind}.tp{n}.pt2", n)
            for kind in kinds
        }
        files = []
        for rank in range(n):
            part = first if rank == 0 else shard(config, weights, rank, n, expert)
            name = f"weights.tp{n}.rank{rank}.safetensors"
            save_file(part, str(staging / name))
            files.append(mf.WeightsInfo(file=name, dtype=dtype, num_parameters=sum(t.numel() for t in part.values())))
        layouts[str(n)] = mf.ParallelLayout(programs=programs, weights=tuple(files), kv=kv, expert=expert)
    return mf.Parallel(tensor=tuple(sorted(set(sizes) | {1})), layouts=layouts)


def parse_sizes(text: str) -> tuple[int, ...]:
    """--tensor-parallel "1,2,4" -> (1, 2, 4); positive integers."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--tensor-parallel must be comma-separated sizes, e.g. 1,2,4, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise UsageError(f"--tensor-parallel sizes must be positive, got {text!r}")
    return sizes
