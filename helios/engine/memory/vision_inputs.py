"""Host retention of CPU vision inputs: an image's prepared views (the vision program's
pixel_values and pixel_positions) and a description of its source, kept in a host store's DRAM
and disk tiers (host_store.py: the same budgets, checksums and record files) so that an image
sent again, after a restart too, is neither decoded nor preprocessed (spec "Configured host
memory and disk retention also cache source descriptions and CPU vision inputs").

A record is keyed by the image's content digest (its bytes and the profile's settings); the
store's identity names everything else the views depend on (the profile and the preparation
code), so a store directory holds records of exactly one preparation. The record's token field
is the source description and the views' shapes; its payload every view's positions (int64)
then every view's pixel values (fp32). A record that is missing, evicted, fails its checksum or
does not match its image is a miss: the caller rebuilds the views from the supplied image data.
No vision features are kept here (nor on the device): the vision program still runs.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
import weakref
from pathlib import Path

import torch
from torch import Tensor

from helios.engine.memory.host_store import HostStore, Record

Views = list[tuple[Tensor, Tensor]]  # per view: pixel_values [X, D] fp32, pixel_positions [X, 2] int64
_OPEN: weakref.WeakSet[VisionInputStore] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()


class RestoredInputs(list):
    """Views `EngineImage.prepare` restored from host retention: the engine does not count them as
    prepared (flare_input_prepared_images_total counts resizing and normalizing work done)."""


def vision_identity(preparation: str) -> bytes:
    """The identity of a store of vision inputs from a description of how they were prepared."""
    return hashlib.blake2b(b"flare-vision-inputs-v1|" + preparation.encode(), digest_size=32).digest()


class VisionInputStore:
    """Prepared vision inputs by image digest in a HostStore of their own identity.

    `source` describes the image as the caller read it from its header (format number, width,
    height, encoded bytes); a record is served only for the same description."""

    def __init__(self, identity: bytes, memory_bytes: int, directory: Path | None, disk_bytes: int) -> None:
        self.store = HostStore(identity, memory_bytes, directory, disk_bytes)
        with _OPEN_LOCK:
            _OPEN.add(self)

    def holds(self, digest: bytes, source: tuple[int, ...]) -> bool:
        """Whether a sound record for this image is in DRAM now (read and verified from disk if needed)."""
        return self._record(digest, source) is not None

    def restore(self, digest: bytes, source: tuple[int, ...]) -> RestoredInputs | None:
        """The image's views, or None (never retained, evicted, corrupt): rebuild them from the image."""
        record = self._record(digest, source)
        if record is None:
            return None
        shapes = record.tokens[len(source) + 1 :]
        positions, pixels, offset = [], [], 0
        for rows in shapes[0::2]:
            positions.append(record.payload[offset : offset + rows * 16].view(torch.int64).view(rows, 2))
            offset += rows * 16
        for rows, width in zip(shapes[0::2], shapes[1::2]):
            pixels.append(record.payload[offset : offset + rows * width * 4].view(torch.float32).view(rows, width))
            offset += rows * width * 4
        return RestoredInputs(zip(pixels, positions))

    def retain(self, digest: bytes, source: tuple[int, ...], views: Views) -> bool:
        """Keep freshly prepared views (DRAM now, disk by the store's writer); False when their
        types are not the vision program's (then nothing is kept)."""
        if any(p.dtype != torch.float32 or q.dtype != torch.int64 or p.dim() != 2 for p, q in views):
            return False
        shapes = tuple(n for p, _ in views for n in p.shape)
        parts = [q.contiguous().view(-1).view(torch.uint8) for _, q in views]
        parts += [p.contiguous().view(-1).view(torch.uint8) for p, _ in views]
        payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        self.store.put([Record(digest, b"", (*source, len(views), *shapes), payload)])
        return True

    def _record(self, digest: bytes, source: tuple[int, ...]) -> Record | None:
        record = self.store.get(digest)
        if record is None:
            return None
        if _sound(record, source):
            return record
        self.store.discard(digest)  # another image under this digest, or a layout it cannot be: never served
        return None

    # ------------------------------------------------------------------ gauges and shutdown
    @property
    def memory_records(self) -> int:
        return self.store.memory_records

    @property
    def disk_records(self) -> int:
        return self.store.disk_records

    def flush(self) -> None:
        """Wait for queued disk writes (tests, shutdown)."""
        self.store.flush()

    def close(self) -> None:
        self.store.close()


def _sound(record: Record, source: tuple[int, ...]) -> bool:
    """Whether a (checksum-verified) record describes this source and its payload fits its shapes."""
    tokens, head = record.tokens, len(source)
    if tokens[:head] != source or len(tokens) <= head:
        return False
    count, shapes = tokens[head], tokens[head + 1 :]
    if count < 1 or len(shapes) != 2 * count or any(n < 1 for n in shapes):
        return False
    size = sum(rows * 16 + rows * width * 4 for rows, width in zip(shapes[0::2], shapes[1::2]))
    return record.parent == b"" and size == record.nbytes


@atexit.register
def _flush_open_stores() -> None:
    """Finish queued record writes before the interpreter stops (the writer is a daemon thread)."""
    with _OPEN_LOCK:
        stores = list(_OPEN)
    for store in stores:
        store.close()
