"""Tensor- and expert-parallel rank programs and weight shards (`ignition export --tensor-parallel`).

For each declared size N > 1 the exporter traces the step program(s) with the sharded config
(heads, kv heads and MLP width / N, or the largest uneven share where N does not divide them, the
smaller shares zero-padded; experts / N with expert parallel; the vocabulary in ceil(V / N)
rows a rank, the last padded) and `tp = N`, so the program
calls flare::all_reduce after its row-parallel projections and its vocabulary-parallel embedding,
and flare::all_gather on its vocabulary-parallel head's logits (ignition.models.step.StepModule).
One program per kind serves every rank: a rank's offsets (`vocab_start`, `expert_start`) are [1]
int64 weights in its shard. docs/parallel.md describes the layout; docs/core-format.md the manifest.

Each family's rules (which sizes it splits into, the rank config, how each weight splits) are in
ignition.parallel_rules; a family without rules is refused with the missing piece (MISSING).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from helios.core import manifest as mf
from ignition.errors import UsageError
from ignition.models.family import Family
from ignition.parallel_rules import RULES, Slice

# family -> what is missing for it (the refusal names it; docs/parallel.md lists them). The families
# with sharding rules are ignition.parallel_rules.RULES's.
SUPPORTED = tuple(RULES)
MISSING = {
    "glm_moe_dsa": "multi-head latent attention with the DeepSeek Sparse Attention indexer's sharding",
    "qwen3_next": "recurrent-state (gated delta rule) sharding",
    "nemotron_h": "recurrent-state (Mamba-2) sharding",
    "glm5_next": "recurrent-state (KDA) and k-pool indexer sharding",
    "gemma3": "sliding-window and softcapped head sharding rules",
    "gemma4": "per-layer embeddings, shared KV and vision sharding rules",
    "muse_spark": "its attention, shared experts and vision sharding rules",
    "step5": "its attention, MoE and vision sharding rules",
    "mimo_v2": "sink attention and MTP program sharding",
}

ExportProgram = Callable[..., mf.ProgramSpec]


def check(fam: Family, config: object, sizes: tuple[int, ...], expert: bool) -> None:
    """Refuse sizes the family or config cannot be split into, naming the size and the piece."""
    wanted = [n for n in sizes if n > 1]
    if not wanted:
        if expert:
            raise UsageError("--expert-parallel needs a --tensor-parallel size above 1")
        return
    rules = RULES.get(fam.name)
    if rules is None:
        missing = MISSING.get(fam.name, "its step program's sharding rules (ignition/parallel_rules.py)")
        raise UsageError(
            f"--tensor-parallel {','.join(map(str, sizes))}: the {fam.name} family cannot be exported for "
            f"more than one rank yet: missing {missing} (docs/parallel.md)"
        )
    if expert and not rules.experts(config):
        raise UsageError(f"--expert-parallel: the {fam.name} family (this config) has no experts")
    if fam.vision_of(config) is not None:
        raise UsageError(f"--tensor-parallel: vision cores ({fam.name}) are not split across ranks yet")
    for n in wanted:
        why = rules.refusal(config, n, expert)
        if why is not None:
            raise UsageError(f"--tensor-parallel {n}: {why}")


def sharded_config(fam: Family, config: object, n: int, expert: bool) -> object:
    """The config a rank program is traced with: heads and widths / n (experts stay whole under
    expert parallel; the router always sees every expert)."""
    return RULES[fam.name].rank_config(config, n, expert)


def _vocab_rows(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """A rank's ceil(V / n) vocabulary rows; the last rank's padded with zero rows (a padded row is
    never looked up, and its logit is cut after the gather: StepModule.gather_vocab)."""
    size = -(-t.shape[0] // n)
    part = t[rank * size : (rank + 1) * size]
    if part.shape[0] == size:
        return part
    return torch.cat([part, part.new_zeros(size - part.shape[0], *t.shape[1:])])


def shard(
    fam: Family, config: object, weights: dict[str, torch.Tensor], rank: int, n: int, expert: bool
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights of n: vocabulary rows of embed and lm_head, every other tensor as the
    family's rules split it (ignition.parallel_rules); a tensor without a rule is refused."""
    rules = RULES[fam.name]
    where = Slice(config, rank, n, expert)
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if rules.dropped(config, name):
            continue
        part = _vocab_rows(t, rank, n) if name in ("embed", "lm_head") else rules.split(name, t, where)
        if part is None:
            raise UsageError(f"--tensor-parallel: no sharding rule for weight {name!r} ({fam.name})")
        out[name] = part.contiguous()
    vocab = -(-weights["embed"].shape[0] // n)
    out["vocab_start"] = torch.tensor([rank * vocab], dtype=torch.int64)
    if expert:
        experts = rules.experts(config) // n
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
        rank_config = sharded_config(fam, config, n, expert)
        kv = kv_of(rank_config)
        first = shard(fam, config, weights, 0, n, expert)
        programs = {
            kind: export_program(rank_config, kind, first, kv, staging / "programs" / f"{kind}.tp{n}.pt2", n)
            for kind in kinds
        }
        files = []
        for rank in range(n):
            part = first if rank == 0 else shard(fam, config, weights, rank, n, expert)
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
