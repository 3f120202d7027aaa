"""Host-resident embedding tables (manifest.HostEmbedding): a table's rows from the core's weights
file, in RAM or through a memory map; the ids a step gathers; and `HostFed`, a program whose
table inputs are gathered from such a table, for the self-contained paths (export's self-check,
the golden recheck, tests). The serving engine gathers through its device row cache instead
(helios.engine.memory.embedding_rows).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from helios.core.manifest import HostEmbedding

RAM = "ram"
DISK = "disk"
SOURCES = (RAM, DISK)


def table_bytes(entry: HostEmbedding) -> int:
    return entry.rows * row_bytes(entry)


def row_bytes(entry: HostEmbedding) -> int:
    return entry.width * getattr(torch, entry.dtype).itemsize


def open_table(root: Path, entry: HostEmbedding, source: str = DISK) -> Tensor:
    """The table as a CPU tensor [rows, width]. `ram`: read into memory once (its whole size);
    `disk`: a private memory map of the weights file, so a gather reads only the rows it touches,
    from the page cache or the disk. Both hold the same bytes."""
    if source not in SOURCES:
        raise ValueError(f"host embedding source must be one of {', '.join(SOURCES)}, got {source!r}")
    path = root / entry.file
    dtype = getattr(torch, entry.dtype)
    nbytes = table_bytes(entry)
    size = path.stat().st_size
    if entry.offset < 0 or entry.offset + nbytes > size:
        raise ValueError(
            f"{path}: host embedding {entry.name!r} ends at byte {entry.offset + nbytes}, past the file's "
            f"{size} bytes; re-export the core"
        )
    if nbytes == 0:
        return torch.empty(entry.rows, entry.width, dtype=dtype)
    if source == RAM:
        table = torch.empty(entry.rows, entry.width, dtype=dtype)
        with open(path, "rb") as handle:
            handle.seek(entry.offset)
            read = handle.readinto(table.view(-1).view(torch.uint8).numpy())  # type: ignore[attr-defined]
        if read != nbytes:
            raise ValueError(f"{path}: short read of host embedding {entry.name!r}; re-export the core")
        return table
    # mmap offsets are multiples of the allocation granularity: map from the one before the table.
    start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as handle:
        region = mmap.mmap(handle.fileno(), entry.offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
    # ACCESS_COPY: a writable (private) mapping torch can wrap without copying; nothing writes it.
    data = torch.frombuffer(region, dtype=torch.uint8, offset=entry.offset - start, count=nbytes)
    return data.view(dtype).view(entry.rows, entry.width)  # the tensor keeps the mapping alive


def row_ids(token_ids: Tensor, image_rows: Tensor | None, image_row_id: int | None) -> Tensor:
    """The table row of each step row: its token id, or image_row_id where the row's input
    embedding is an image feature (image_rows: the step's flat rows, -1 unused)."""
    if image_row_id is None or image_rows is None:
        return token_ids
    rows = image_rows[image_rows >= 0].to(token_ids.device)
    if not rows.numel():
        return token_ids
    return token_ids.index_fill(0, rows, image_row_id)


class HostFed:
    """A loaded program whose host-table inputs are gathered here from in-memory (or mapped) tables:
    called like the program it wraps, without those inputs, and with any weights dict (the tables'
    own entries are dropped), so run_prompt and the checks serve a --host-embeddings core unchanged."""

    def __init__(self, program: Any, tables: Iterable[tuple[HostEmbedding, Tensor]]) -> None:
        self.program = program
        self.kind, self.spec = program.kind, program.spec
        tables = tuple(tables)
        self.fed = {entry.input: (entry, table) for entry, table in tables if entry.input in program.input_names}
        self.table_names = frozenset(entry.name for entry, _ in tables)  # no program of the core takes these
        self.input_names = tuple(name for name in program.input_names if name not in self.fed)
        self.output_names = program.output_names

    def __call__(self, weights: dict[str, Tensor], kv_cache: list[Tensor], **inputs: Tensor) -> dict[str, Tensor]:
        for name, (entry, table) in self.fed.items():
            token_ids = inputs["token_ids"]
            ids = row_ids(token_ids, inputs.get("image_rows"), entry.image_row_id).cpu()
            inputs[name] = table.index_select(0, ids).to(token_ids.device)
        program_weights = {k: v for k, v in weights.items() if k not in self.table_names}
        return self.program(program_weights, kv_cache, **inputs)


__all__ = ["DISK", "RAM", "SOURCES", "HostFed", "open_table", "row_bytes", "row_ids", "table_bytes"]
