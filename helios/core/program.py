"""Exported step programs: their calling convention (format v1) and a loaded wrapper.

Every program is called as `program(weights, kv_cache, *inputs)` where `weights` is the
dict stored in the core's safetensors, `kv_cache` is the list [k0, v0, k1, v1, ...] of
page tensors [num_pages, page_tokens, num_kv_heads, head_dim], then the layout's extra
caches (KvLayout.cache_shapes), then its recurrent state tensors [num_slots, *shape]
(KvLayout.state_shapes), all updated in place, and
`inputs` follow the manifest's input specs in order. Outputs follow the output specs.

Recurrent state: a core whose layout has state takes `state_slots` [B], the slot of each
sequence. A sequence whose first position in the step is 0 starts from zero state (its
slot's contents are ignored); otherwise its slot holds the state after all its earlier
tokens. The program leaves the state after the sequence's last token of the step there.
"""

from __future__ import annotations

import collections
import contextlib
import math
import mmap
import os
import threading
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import Tensor

import helios.core.ops  # noqa: F401  (registers the flare:: ops the graphs call)
from helios.core.manifest import KvLayout, ProgramSpec, TensorSpec

STEP = "step"
SCORED_PREFILL = "scored_prefill"
VISION = "vision"


def program_signature(
    kind: str,
    num_top: int,
    explicit_ids: bool,
    state: bool = False,
    vision: int = 0,
    window: bool = False,
    bidirectional: bool = False,
    host_rows: tuple[TensorSpec, ...] = (),
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Input and output specs of a program kind, for a core's logprob capabilities.

    Dims: T tokens in the step, B sequences, M blocks per sequence table, R rows whose
    next-token distribution is returned, K explicit ids per row, V vocabulary, N = num_top,
    I image-feature rows; `vision` is the feature width (the language model's hidden size), 0 for text-only.

    Vision cores' step programs take two more inputs, last: `image_features` [I, vision] fp32 (vision
    program outputs) and `image_rows` [I] int64, the flat step rows whose input embedding each
    feature row replaces (-1: an unused row, so a step without image rows passes one dummy
    row). Text-only cores keep the signature without them.

    Cores with a window pool (KvLayout.window_pool) take `window_slot_mapping` [T] and
    `window_block_tables` [B, M] after state_slots: the slots and page tables of the window pool's
    caches, over the same logical pages as slot_mapping and block_tables.

    Vision cores whose image tokens attend each other both ways (`bidirectional`) take
    `attention_until` [T] int64 after image_rows: the last key each row may see (the end of its
    image's span for an image token, its own position otherwise; flare::paged_attention_until).

    `host_rows`: inputs [T, width] fed from host-resident embedding tables (manifest.HostEmbedding,
    export --host-embeddings), last: each step row's table row, gathered by the runner.
    """
    inputs = [
        TensorSpec("token_ids", "int64", ("T",)),
        TensorSpec("positions", "int64", ("T",)),
        TensorSpec("slot_mapping", "int64", ("T",)),  # page * page_tokens + offset; -1 = padding
        TensorSpec("block_tables", "int32", ("B", "M")),
        TensorSpec("seq_lens", "int32", ("B",)),  # KV length after this step
        TensorSpec("query_start_loc", "int32", ("B+1",)),
        TensorSpec("logits_indices", "int64", ("R",)),  # token rows whose distributions are returned
    ]
    if state:
        inputs.append(TensorSpec("state_slots", "int64", ("B",)))  # recurrent-state slot of each sequence
    if window:
        inputs.append(TensorSpec("window_slot_mapping", "int64", ("T",)))
        inputs.append(TensorSpec("window_block_tables", "int32", ("B", "M")))
    if explicit_ids:
        inputs.append(TensorSpec("logprob_token_ids", "int64", ("R", "K")))
    if kind == SCORED_PREFILL:
        inputs.append(TensorSpec("target_ids", "int64", ("T",)))  # next prompt token of each row
    if vision:
        inputs.append(TensorSpec("image_features", "float32", ("I", vision)))
        inputs.append(TensorSpec("image_rows", "int64", ("I",)))
        if bidirectional:
            inputs.append(TensorSpec("attention_until", "int64", ("T",)))
    inputs += host_rows
    outputs = [TensorSpec("logits", "float32", ("R", "V")), TensorSpec("logsumexp", "float32", ("R",))]
    if num_top:
        outputs += [
            TensorSpec("top_logprobs", "float32", ("R", num_top)),
            TensorSpec("top_ids", "int64", ("R", num_top)),
        ]
    if explicit_ids:
        outputs.append(TensorSpec("explicit_logprobs", "float32", ("R", "K")))
    if kind == SCORED_PREFILL:
        outputs += [TensorSpec("prompt_logprobs", "float32", ("T",)), TensorSpec("prompt_ranks", "int64", ("T",))]
        if num_top:
            outputs += [
                TensorSpec("prompt_top_logprobs", "float32", ("T", num_top)),
                TensorSpec("prompt_top_ids", "int64", ("T", num_top)),
            ]
    return tuple(inputs), tuple(outputs)


def vision_signature(patch_dim: int, feature_dim: int) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The `vision` program (vision cores): one image's patches -> its image-token embeddings.

    Called as program(weights, [], pixel_values, pixel_positions). X patches of one image (no
    padding), F = X / pooling_kernel_size^2 tokens in the profile's order, already projected
    into the language model's embedding space (the step's image_features rows).
    """
    inputs = (TensorSpec("pixel_values", "float32", ("X", patch_dim)), TensorSpec("pixel_positions", "int64", ("X", 2)))
    return inputs, (TensorSpec("image_features", "float32", ("F", feature_dim)),)


_LOOKUPS_LOCK = threading.Lock()


class _Callable:
    """What every loaded program shares: named inputs in, named outputs out."""

    def __init__(self, kind: str, spec: ProgramSpec) -> None:
        self.kind = kind
        self.spec = spec
        self.input_names = tuple(t.name for t in spec.inputs)
        self.output_names = tuple(t.name for t in spec.outputs)

    def __call__(self, weights: dict[str, Tensor], kv_cache: list[Tensor], **inputs: Tensor) -> dict[str, Tensor]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise TypeError(f"{self.kind} program needs inputs {missing}")
        with torch.inference_mode():
            outputs = self._run(weights, kv_cache, [inputs[n] for n in self.input_names])
        return dict(zip(self.output_names, outputs, strict=True))

    def _run(self, weights: dict[str, Tensor], kv_cache: list[Tensor], inputs: list[Tensor]) -> Any:
        raise NotImplementedError


class Program(_Callable):
    """A loaded exported program with named inputs and outputs."""

    def __init__(self, kind: str, spec: ProgramSpec, module: torch.nn.Module) -> None:
        super().__init__(kind, spec)
        self.module = module

    @classmethod
    def load(cls, kind: str, spec: ProgramSpec, path: Path, check_guards: bool = True) -> Program:
        """check_guards=False skips per-call input-shape checks (callers that build inputs themselves)."""
        module = _exported(path).module(check_guards=check_guards)
        if not check_guards:
            # The unlifted module still validates inputs against the range constraints with
            # sympy on every call (several ms per decode step); callers that build their
            # inputs themselves drop that hook too.
            for key, hook in list(module._forward_pre_hooks.items()):
                if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
                    del module._forward_pre_hooks[key]
        return cls(kind, spec, module)

    def _run(self, weights: dict[str, Tensor], kv_cache: list[Tensor], inputs: list[Tensor]) -> Any:
        return self.module(weights, kv_cache, *inputs)


_EXPORTED: collections.OrderedDict[tuple, torch.export.ExportedProgram] = collections.OrderedDict()
_EXPORTED_LOCK = threading.Lock()
_EXPORTED_KEEP = 16  # programs kept deserialized per process (a core has a few; tests open many)


def _exported(path: Path) -> torch.export.ExportedProgram:
    """The deserialized program at `path`, kept per process: deserializing a .pt2 rebuilds every
    node's fake tensors and symbolic shapes (seconds for a small model's step), while unlifting a
    fresh module from it (`.module()`, which each caller gets its own of) takes a tenth of that.
    Keyed by the file's identity (device, inode, size, modification time: a rewritten file is
    read again, a renamed one, like export's staging directory becoming the core, is not)."""
    info = path.stat()
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    with _EXPORTED_LOCK:
        if key in _EXPORTED:
            _EXPORTED.move_to_end(key)
            return _EXPORTED[key]
    with _memoized_lookups():
        exported = torch.export.load(str(path))
    with _EXPORTED_LOCK:
        _EXPORTED[key] = exported
        while len(_EXPORTED) > _EXPORTED_KEEP:
            _EXPORTED.popitem(last=False)
    return exported


class CompiledProgram(_Callable):
    """A program compiled ahead of time (AOTInductor) for one host, its weights inside.

    Called like `Program` (the weights argument is accepted and ignored), so the engine and
    the export checks run either interchangeably.
    """

    def __init__(self, kind: str, spec: ProgramSpec, runner: Any) -> None:
        super().__init__(kind, spec)
        self.runner = runner

    @classmethod
    def load(
        cls, kind: str, spec: ProgramSpec, path: Path, runner: Callable[[str], Any] | None = None
    ) -> CompiledProgram:
        """runner: builds the object whose .run(tensors) runs the shared object (default: torch's
        AOTInductor runner, which holds the GIL while it runs)."""
        # The shared object is loaded in place (no package to extract); its constants are the
        # packed weights, so the core's safetensors are not needed for this program. One model
        # instance: the engine calls it from one thread.
        make = runner or (lambda file: torch._C._aoti.AOTIModelContainerRunnerCpu(file, 1))
        return cls(kind, spec, make(str(path)))

    def _run(self, weights: dict[str, Tensor], kv_cache: list[Tensor], inputs: list[Tensor]) -> Any:
        # Flattened as the program was traced: every cache tensor, then the inputs in order.
        return self.runner.run([*kv_cache, *inputs])


def allocate_kv(
    layout: KvLayout,
    num_pages: int,
    page_tokens: int,
    device: str = "cpu",
    num_slots: int = 1,
    num_window_pages: int | None = None,
) -> list[Tensor]:
    """A zeroed paged cache: [k0, v0, k1, v1, ...] (shared_kv: [kv0, kv1, ...]), then the
    layout's extra caches, each [num_pages, page_tokens, heads, head_dim] (KvLayout.cache_shapes;
    the window pool's tensors num_window_pages, default num_pages), then its state tensors
    [num_slots, *shape] (KvLayout.state_shapes; none without state)."""
    dtype = getattr(torch, layout.dtype)
    windowed = set(layout.window_pool.caches) if layout.window_pool is not None else set()
    window_pages = num_pages if num_window_pages is None else num_window_pages
    shapes = [
        ((window_pages if index in windowed else num_pages, page_tokens, heads, dim), dtype)
        for index, (heads, dim) in enumerate(layout.cache_shapes())
    ]
    shapes += [((num_slots, *shape), getattr(torch, state_dtype)) for shape, state_dtype in layout.state_shapes()]
    if device != "cpu":
        return [torch.zeros(shape, dtype=dt, device=device) for shape, dt in shapes]
    # calloc'd memory: fresh zero pages the kernel maps on first write, not a 1 GB memset at startup
    return [_zeros(shape, dt) for shape, dt in shapes]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Anonymous mapped memory (zero pages the kernel maps on first write), on transparent huge
    pages only where this process's malloc uses them (helios.hugepages decides at startup).
    numpy's zeros would madvise every large array onto huge pages; where their first touch is
    slow (80 ms per 64 MiB, against 13 ms for 4 KiB pages, on one VM) every page a step or a
    host-store restore first writes paid for it on the engine thread."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel without THP: plain pages
            pass
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping alive


@dataclass(frozen=True, slots=True)
class DenseRun:
    """Outputs of running one prompt through a program, one row per prompt position."""

    logprobs: Tensor  # [T, V] full-vocabulary logprobs (logit - logsumexp)
    outputs: dict[str, Tensor]  # every program output, rows concatenated over chunks


def run_prompt(
    program: Program,
    weights: dict[str, Tensor],
    layout: KvLayout,
    page_tokens: int,
    token_ids: list[int],
    chunk: int | None = None,
    explicit_ids: list[int] | None = None,
    image_features: Tensor | None = None,
    image_positions: list[int] | None = None,
) -> DenseRun:
    """Prefill one sequence in chunks of `chunk` tokens through the paged cache.

    A self-contained check path (verify, tests); the engine batches many sequences itself.
    Vision cores: row i of `image_features` [len(image_positions), hidden] replaces the input
    embedding at prompt position image_positions[i].
    """
    total = len(token_ids)
    chunk = chunk or total
    num_pages = math.ceil(total / page_tokens) + 1
    kv = allocate_kv(layout, num_pages, page_tokens)
    # Use pages in reverse order so a wrong block-table lookup cannot pass by accident.
    pages = list(reversed(range(num_pages)))[: math.ceil(total / page_tokens)]
    block_table = torch.tensor([pages], dtype=torch.int32)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    collected: dict[str, list[Tensor]] = {}
    bidirectional = "attention_until" in program.input_names
    runs = image_runs(image_positions or []) if bidirectional else []
    start = 0
    while start < total:
        end = min(total, start + chunk)
        for s, e in runs:  # a bidirectional image is never split between chunks: its keys are all written first
            if s < end < e:
                end = e
        positions = torch.arange(start, end, dtype=torch.int64)
        slots = torch.tensor([pages[p // page_tokens] * page_tokens + p % page_tokens for p in range(start, end)])
        inputs = {
            "token_ids": ids[start:end],
            "positions": positions,
            "slot_mapping": slots,
            "block_tables": block_table,
            "seq_lens": torch.tensor([end], dtype=torch.int32),
            "query_start_loc": torch.tensor([0, end - start], dtype=torch.int32),
            "logits_indices": torch.arange(end - start, dtype=torch.int64),
        }
        if "state_slots" in program.input_names:  # one sequence in slot 0, carried across chunks
            inputs["state_slots"] = torch.zeros(1, dtype=torch.int64)
        if "window_slot_mapping" in program.input_names:  # no reclaiming here: the window caches mirror the pool
            inputs["window_slot_mapping"], inputs["window_block_tables"] = slots, block_table
        if "logprob_token_ids" in program.input_names:
            chosen = explicit_ids or [0]
            inputs["logprob_token_ids"] = torch.tensor([chosen] * (end - start), dtype=torch.int64)
        if "target_ids" in program.input_names:
            inputs["target_ids"] = torch.cat([ids[start + 1 : end + 1], torch.full((max(0, end + 1 - total),), -1)])
        if "image_features" in program.input_names:
            inputs["image_features"], inputs["image_rows"] = chunk_image_inputs(
                program, image_features, image_positions or [], start, end
            )
        if bidirectional:
            inputs["attention_until"] = attention_until(range(start, end), runs)
        for name, value in program(weights, kv, **inputs).items():
            collected.setdefault(name, []).append(value)
        start = end
    outputs = {name: torch.cat(parts) for name, parts in collected.items()}
    logprobs = outputs["logits"] - outputs["logsumexp"][:, None]
    return DenseRun(logprobs=logprobs, outputs=outputs)


def image_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [s, e) of consecutive image positions (one image's tokens, as transformers'
    block sequence ids group them)."""
    runs: list[tuple[int, int]] = []
    for p in sorted(positions):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def attention_until(positions: range | list[int], runs: list[tuple[int, int]]) -> Tensor:
    """The attention_until input of these positions: an image run's last position for its tokens,
    the position itself elsewhere."""
    out = list(positions)
    for index, p in enumerate(out):
        for s, e in runs:
            if s <= p < e:
                out[index] = e - 1
    return torch.tensor(out, dtype=torch.int64)


def chunk_image_inputs(
    program: _Callable, features: Tensor | None, positions: list[int], start: int, end: int
) -> tuple[Tensor, Tensor]:
    """(image_features, image_rows) of one chunk [start, end) of a sequence: the feature rows at
    positions inside it, or one dummy row (-1) when there are none."""
    width = next(int(t.shape[1]) for t in program.spec.inputs if t.name == "image_features")
    picked = [(i, p - start) for i, p in enumerate(positions) if start <= p < end]
    if not picked or features is None:
        return torch.zeros(1, width), torch.full((1,), -1, dtype=torch.int64)
    return features[[i for i, _ in picked]].float(), torch.tensor([r for _, r in picked], dtype=torch.int64)


@contextlib.contextmanager
def _memoized_lookups() -> Iterator[None]:
    """torch.export's deserializer asks typing.get_type_hints about the same few schema classes
    some 40,000 times per program (half of a load), and parses the same symbolic-shape strings
    ("s0", "64*s0", ...) with sympy.sympify again at every node (a fifth of the rest); answer
    repeats from memos while it runs. Within one load a string always parses to the same
    expression: the symbols it names are registered the first time they are seen and never
    change, so the memo hands back what a fresh parse would."""
    real_hints, real_sympify = typing.get_type_hints, sympy.sympify
    memo: dict[tuple[object, bool], dict[str, Any]] = {}
    parsed: dict[str, Any] = {}

    def cached(obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False) -> dict[str, Any]:
        key = (obj, include_extras)
        if localns is not None or key not in memo:
            hints = real_hints(obj, globalns, localns, include_extras)
            if localns is not None:
                return hints
            memo[key] = hints
        return memo[key]

    def sympify(a: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(a, str) or args or set(kwargs) - {"locals"}:
            return real_sympify(a, *args, **kwargs)
        if a not in parsed:
            parsed[a] = real_sympify(a, **kwargs)
        return parsed[a]

    with _LOOKUPS_LOCK:
        typing.get_type_hints = cached  # type: ignore[assignment]
        sympy.sympify = sympify
        try:
            yield
        finally:
            typing.get_type_hints = real_hints
            sympy.sympify = real_sympify
