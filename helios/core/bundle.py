"""Open a core bundle: check its format version and checksums, expose its parts.

This module knows the bundle layout, not any model architecture: the model's
computation comes from the exported programs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from helios.core import hostcache, quant
from helios.core import manifest as mf
from helios.core.host_rows import DISK, HostFed, open_table
from helios.core.ops import catalog as ops_catalog
from helios.core.program import SCORED_PREFILL, STEP, CompiledProgram, Program

CHUNK = 1 << 22


class CoreError(Exception):
    """The core cannot be used; the message names the file or value and what to do."""


class CoreFormatError(CoreError):
    """The core's format version is not the one this code understands."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


_VERIFIED = "verified-files"


def _stamp(path: Path) -> list[int]:
    """What changes when a file's bytes change (the same test git's index makes)."""
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def core_digest(files: dict[str, str]) -> str:
    """One checksum for a whole core (a build-cache key): over its sorted file hashes.

    core.json is excluded, since it carries the export timestamp; everything it
    describes is covered by the files it lists.
    """
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class StoredWeight:
    """One quantized weight as the weights file holds it (layout: helios.core.quant)."""

    spec: mf.QuantizedTensor
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None  # int4 only

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight the programs take (float32 arithmetic, then `dtype`; None: the spec's)."""
        target = dtype if dtype is not None else getattr(torch, self.spec.dtype)
        return quant.dequantize(self.qweight, self.scales, self.mins, self.spec.group, target)


@dataclass(frozen=True)
class Core:
    root: Path
    manifest: mf.Manifest

    @classmethod
    def open(cls, root: str | Path, verify_checksums: bool = True, trust_unchanged: bool = False) -> Core:
        """trust_unchanged: skip re-hashing a file whose size, inode and times are those it had
        when it last hashed correctly on this host (helios.core.hostcache); `ignition verify`
        always hashes everything."""
        root = Path(root)
        path = root / mf.MANIFEST_FILE
        if not path.is_file():
            raise CoreError(f"{root}: no {mf.MANIFEST_FILE}, so this is not a core (build one with `ignition export`)")
        try:
            manifest = mf.decode(path.read_bytes())
        except mf.FormatTooNew as exc:
            raise CoreFormatError(f"{path}: {exc}") from exc
        except mf.ManifestError as exc:
            raise CoreError(f"{path}: {exc}") from exc
        unsupported = ops_catalog.problem(manifest.ops.namespace, manifest.ops.version, manifest.ops.ops)
        if unsupported is not None:
            raise CoreFormatError(f"{path}: {unsupported}")
        core = cls(root, manifest)
        if verify_checksums:
            core.verify_checksums(trust_unchanged)
        return core

    def verify_checksums(self, trust_unchanged: bool = False) -> None:
        known = hostcache.load(_VERIFIED) if trust_unchanged else {}
        verified: dict[str, list] = {}
        try:
            for name, expected in sorted(self.manifest.files.items()):
                path = self.root / name
                if not path.is_file():
                    raise CoreError(f"{path}: missing from the core (listed in {mf.MANIFEST_FILE}); re-export the core")
                stamp = [*_stamp(path), expected]
                key = str(path.resolve())
                if known.get(key) == stamp:
                    continue
                actual = sha256_file(path)
                if actual != expected:
                    raise CoreError(
                        f"{path}: checksum mismatch (sha256 {actual[:16]}…, manifest says {expected[:16]}…); "
                        "the file is corrupted or was modified: re-export the core"
                    )
                verified[key] = stamp
        finally:  # one write for the whole core, also keeping what passed before a failure
            hostcache.put_many(_VERIFIED, verified, keep=4096)

    @property
    def digest(self) -> str:
        return core_digest(self.manifest.files)

    def load_weights(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The programs' weights argument. Host tables (manifest.host_embeddings) stay out: the
        programs take their rows as inputs, and a table may be larger than the device. A quantized
        weight (manifest.quantization) comes dequantized to the dtype the programs take it in (the
        engine instead runs what it can on the stored values: load_stored, helios.engine.quantized)."""
        plain, stored = self.load_stored(device)
        if not stored:
            return plain
        return dict(sorted({**plain, **{name: weight.dequantize() for name, weight in stored.items()}}.items()))

    def load_stored(self, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, StoredWeight]]:
        """The weights file read once: the programs' weights stored as they are taken, sorted by
        name, and each quantized weight's stored tensors apart (empty for an unquantized core)."""
        # Sorted by name, the order export traced the programs with: safetensors files order
        # tensors by dtype first, and a program's weights argument is flattened by position.
        path = str(self.root / self.manifest.weights.file)
        hosted = {entry.name for entry in self.manifest.host_embeddings}
        quantized = self.manifest.quantization.tensors if self.manifest.quantization is not None else {}
        if not hosted and not quantized:
            return dict(sorted(load_file(path, device=device).items())), {}
        parts = {part: name for name, spec in quantized.items() for part in quant.stored_names(name, spec.format)}
        with safe_open(path, framework="pt", device=device) as handle:
            names = set(handle.keys())
            missing = sorted(set(parts) - names)
            if missing:
                raise CoreError(
                    f"{self.root / self.manifest.weights.file}: quantized weight part {missing[0]!r} is missing "
                    f"({len(missing)} of {len(parts)} missing); re-export the core"
                )
            plain = {name: handle.get_tensor(name) for name in sorted(names - hosted - set(parts))}
            stored = {
                name: StoredWeight(
                    spec,
                    handle.get_tensor(name + quant.QWEIGHT),
                    handle.get_tensor(name + quant.SCALES),
                    handle.get_tensor(name + quant.MINS) if spec.format == quant.INT4 else None,
                )
                for name, spec in sorted(quantized.items())
            }
        return plain, stored

    def host_tables(self, source: str = DISK) -> tuple[tuple[mf.HostEmbedding, torch.Tensor], ...]:
        """Each host table with its rows on the CPU (helios.core.host_rows.open_table: "disk" maps the
        weights file, "ram" reads the table into memory)."""
        return tuple((entry, open_table(self.root, entry, source)) for entry in self.manifest.host_embeddings)

    def load_program(self, kind: str = STEP, check_guards: bool = True, fed: bool = True) -> Program | HostFed:
        """fed: a program taking host-table rows comes wrapped (HostFed) to gather them from the mapped
        tables itself; the engine asks for the bare program and feeds it from its row cache."""
        spec = self.manifest.programs.get(kind)
        if spec is None:
            hint = " (export with --prompt-logprobs)" if kind == SCORED_PREFILL else ""
            raise CoreError(f"{self.root}: the core has no {kind!r} program{hint}")
        program = Program.load(kind, spec, self.root / spec.file, check_guards)
        hosted = {entry.input for entry in self.manifest.host_embeddings}
        return HostFed(program, self.host_tables()) if fed and hosted & set(program.input_names) else program

    def load_compiled(self, kind: str = STEP, runner: Callable[[str], Any] | None = None) -> CompiledProgram:
        """The program's ahead-of-time build (the caller checks its host first: helios.core.host);
        runner as CompiledProgram.load's."""
        spec = self.manifest.compiled.get(kind)
        if spec is None:
            raise CoreError(f"{self.root}: the core has no compiled {kind!r} program (export with --compile-step)")
        return CompiledProgram.load(kind, self.manifest.programs[kind], self.root / spec.file, runner)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.root / self.manifest.tokenizer.file))

    def chat_template(self) -> str | None:
        name = self.manifest.tokenizer.chat_template
        return (self.root / name).read_text(encoding="utf-8") if name else None
