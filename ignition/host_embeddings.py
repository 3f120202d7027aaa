"""export --host-embeddings: embedding tables kept out of the step programs.

A family names such tables (its optional `host_embeddings` hook: Gemma 4's per-layer input table,
several GB in E2B/E4B). Under the option the step and scored-prefill programs do not take the table
as a weight; they take its rows, gathered per step token, as their last input
(`<table>_rows` [T, width] in the weight dtype; helios.core.program.program_signature's host_rows).
The table itself stays in weights.safetensors, and the manifest records where its bytes are
(helios.core.manifest.HostEmbedding), so helios can serve it from RAM or a memory map through a
device row cache. The gather is exact: the programs compute the same values either way.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from helios.core import manifest as mf
from helios.core.host_rows import HostFed
from ignition.errors import UsageError
from ignition.models.family import Family

Tables = tuple[tuple[str, int | None], ...]  # (internal weight name, image-row id or None) per table


def planned(fam: Family, config: object, enabled: bool, tensor_parallel: tuple[int, ...], compile_step: bool) -> Tables:
    """The tables the export keeps on the host: none without the option; the family's for this config with it."""
    if not enabled:
        return ()
    tables = fam.host_embeddings(config) if fam.host_embeddings is not None else ()
    if not tables:
        raise UsageError(
            f"--host-embeddings: this {fam.name} checkpoint has no embedding table its family serves from the "
            "host (Gemma 4's per-layer input table is one); export without it"
        )
    if len(tables) > 1:
        raise UsageError(f"--host-embeddings: the {fam.name} family names {len(tables)} tables; programs take one")
    if max(tensor_parallel) > 1:
        raise UsageError("--host-embeddings does not combine with --tensor-parallel yet; export without one of them")
    if compile_step:
        raise UsageError("--host-embeddings does not combine with --compile-step yet; export without one of them")
    return tables


def input_name(table: str) -> str:
    """The step input a table's rows feed."""
    return f"{table}_rows"


def input_specs(tables: Tables, weights: dict[str, Tensor]) -> tuple[mf.TensorSpec, ...]:
    """The programs' host-row inputs: [T, width] in the table's dtype."""
    return tuple(
        mf.TensorSpec(input_name(name), _dtype_name(weights[name].dtype), ("T", int(weights[name].shape[1])))
        for name, _ in tables
    )


def examples(specs: tuple[mf.TensorSpec, ...]) -> dict[str, Tensor]:
    """Tracing examples of the host-row inputs (5 rows, as export's other T-sized examples)."""
    generator = torch.Generator().manual_seed(0)
    return {
        spec.name: torch.randn(5, int(spec.shape[1]), generator=generator).to(getattr(torch, spec.dtype))
        for spec in specs
    }


def program_weights(weights: dict[str, Tensor], tables: Tables) -> dict[str, Tensor]:
    """The programs' weights argument: every weight but the host tables."""
    hosted = {name for name, _ in tables}
    return {name: tensor for name, tensor in weights.items() if name not in hosted}


def entries(tables: Tables, weights: dict[str, Tensor], weights_file: Path) -> tuple[mf.HostEmbedding, ...]:
    """The manifest's records of the tables, with their byte offsets in the written weights file."""
    offsets = _data_offsets(weights_file)
    out = []
    for name, image_row_id in tables:
        table = weights[name]
        out.append(
            mf.HostEmbedding(
                name=name,
                input=input_name(name),
                rows=int(table.shape[0]),
                width=int(table.shape[1]),
                dtype=_dtype_name(table.dtype),
                file=weights_file.name,
                offset=offsets[name],
                image_row_id=image_row_id,
            )
        )
    return tuple(out)


def fed(programs: dict[str, Any], records: tuple[mf.HostEmbedding, ...], weights: dict[str, Tensor]) -> dict[str, Any]:
    """The loaded programs wrapped to gather their host rows from the in-memory tables and to take the
    whole weights dict (the self-checks then run them like any other program); as they are without
    records. A None program stays None."""
    if not records:
        return programs
    tables = [(record, weights[record.name]) for record in records]
    return {kind: HostFed(program, tables) if program is not None else None for kind, program in programs.items()}


def _data_offsets(path: Path) -> dict[str, int]:
    """Absolute byte offset of each tensor's data in a safetensors file (its header: an 8-byte
    little-endian length, then JSON with data_offsets relative to the end of the header)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: 8 + length + int(info["data_offsets"][0]) for name, info in header.items() if name != "__metadata__"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
