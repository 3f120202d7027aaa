"""Runs a step's chunks through the core's programs and returns per-row outputs."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from torch import Tensor

from helios.core import Core, host, hostcache
from helios.core.logs import Stopwatch
from helios.core.manifest import Quantization
from helios.core.onnx_program import OnnxProgram
from helios.core.program import SCORED_PREFILL, STEP, VISION, CompiledProgram, Program, allocate_kv
from helios.engine import (
    devices,
    graph,
    graphs,
    native,
    onnx_runner,
    prepack,
    quantized,
    quantized_ops,  # noqa: F401  (registers the flare_quant:: ops compiled quantized steps call)
    threads,
)
from helios.engine.kernels import registry as kernels
from helios.engine.memory import embedding_rows
from helios.engine.memory.plan import NO_MEMORY_WORK, MemoryPlan
from helios.engine.rows import padded
from helios.engine.sequence import Chunk

log = logging.getLogger("helios.engine")


@dataclass(frozen=True, slots=True)
class StepResult:
    """Outputs of one step, in chunk order, on the step's device (step_output.fetch copies what the
    host reads)."""

    sampled: tuple[Chunk, ...]  # chunks with wants_logits, in row order of the tensors below (chunk.num_rows each)
    logits: Tensor  # [R, V] f32
    logsumexp: Tensor  # [R]
    top_logprobs: Tensor | None  # [R, N]
    top_ids: Tensor | None  # [R, N]
    explicit_logprobs: Tensor | None  # [R, K] for each row's request ids (padded)
    prompt_scores: dict[int, dict[str, Tensor]]  # id(chunk) -> per-token prompt outputs of scored chunks
    # id(chunk) -> the step's final hidden state of each computed position [num_tokens + drafts, hidden]
    # (cores whose step returns "hidden_states", for their learned drafter; empty unless asked for)
    hidden: dict[int, Tensor] = field(default_factory=dict)


def _calls_native(shared_object: Path) -> bool:
    """Whether a compiled step's op descriptions (the .json beside it) name flare_native:: ops."""
    try:
        return "flare_native::" in shared_object.with_suffix(".json").read_text(encoding="utf-8")
    except OSError:
        return False


def _compiled_linears(shared_object: Path) -> str:
    """The linear kernel a compiled step was built on (export measured it): the helios kernel its
    op descriptions call, else oneDNN (packed into the package)."""
    try:
        described = shared_object.with_suffix(".json").read_text(encoding="utf-8")
    except OSError:
        return prepack.ONEDNN
    called = [k for k, op in prepack.OP_NAMES.items() if f'"flare_native::{op}"' in described]
    return called[0] if called else prepack.ONEDNN


def _compiled_quantized(quantization: Quantization) -> quantized.QuantizedLoad:
    """A quantized core's compiled step holds every quantized weight as the blob its native kernels
    read (export refuses to build one that would dequantize any: ignition.compiled.quantized_step)."""
    tensors = quantization.tensors
    dtype = next(iter(tensors.values())).dtype if tensors else ""
    return quantized.QuantizedLoad(quantization.level, tuple(sorted(tensors)), (), dtype, ())


def no_image_rows(program) -> dict[str, Tensor]:
    """A vision core's step inputs for a step without image rows: one unused (-1) row."""
    width = next(int(t.shape[1]) for t in program.spec.inputs if t.name == "image_features")
    return {"image_features": torch.zeros(1, width), "image_rows": torch.full((1,), -1, dtype=torch.int64)}


_STAGING_BYTES = 32 << 20  # host-store restores stage their payloads through a buffer this large


def _attention_until(chunks: tuple[Chunk, ...] | list[Chunk], positions: list[int]) -> Tensor:
    """The last key each step row may see: the end of its image's run for an image token (the
    scheduler never splits an image between chunks), its own position otherwise."""
    until = list(positions)
    offset = 0
    for chunk in chunks:
        count = chunk.num_tokens + len(chunk.draft_ids)
        for image in chunk.seq.request.images:
            if image.end <= chunk.start or image.start >= chunk.start + count:
                continue
            for first, _, rows in image.spans():
                for row in range(offset, offset + count):
                    if first <= positions[row] < first + rows:
                        until[row] = first + rows - 1
        offset += count
    return torch.tensor(until, dtype=torch.int64)


class Executor:
    def __init__(
        self,
        core: Core,
        num_pages: int,
        device: str = "cpu",
        serial_decode_rows: int | None = 0,
        upcast: bool = False,
        compiled: bool = True,
        num_slots: int = 1,
        drafters: tuple[str, ...] = (),
        cuda_graphs: bool = False,
        num_window_pages: int | None = None,
        row_cache: embedding_rows.RowCacheConfig = embedding_rows.RowCacheConfig(),
        runtime: str = onnx_runner.TORCH,
        packed_pages: bool = True,
    ) -> None:
        """serial_decode_rows: decode steps of at most this many rows run on one CPU thread;
        None measures the best threshold on this host (threads.measure). compiled: run the
        core's ahead-of-time step where it was built for this host (else the portable one).
        num_slots: recurrent-state slots of a hybrid core (live plus snapshots; state_slots.py).
        drafters: the core's drafter program kinds to load too (e.g. "mtp_draft.0"); with them
        each step keeps its hidden states (StepResult.hidden). cuda_graphs: on a CUDA device, decode-only
        steps replay a graph captured per decode bucket (graphs.py); the pool gets one scratch page.
        num_window_pages: pages of a window-pool core's sliding-layer caches (window_pages.py; None:
        as many as the main pool's). row_cache: the device row caches of a core's host embedding
        tables (memory/embedding_rows.py; none for other cores). packed_pages: on the CPU, the
        native attention keeps full bfloat16 pages in its tile layout too (native.keep_packed)."""
        clock = Stopwatch(log, "executor startup")
        kernels.register()
        devices.prepare(device)  # CUDA: helios' Triton kernels in the flare:: ops' CUDA slot
        self.linear_kernel = prepack.ONEDNN if device == "cpu" else "device"  # the programs' linears (both steps)
        manifest = core.manifest
        self.device = device
        self.page_tokens = manifest.limits.page_tokens
        has_scored = SCORED_PREFILL in manifest.programs
        # "onnxruntime": the programs as the core's ONNX renditions, which hold their own weights (onnx_runner.py)
        self.runtime = runtime
        onnx = (
            onnx_runner.load(core, device, upcast, has_scored, drafters) if runtime == onnx_runner.ONNXRUNTIME else None
        )
        self.compiled_step, self.compiled_fallback = self._compiled_step(
            core, compiled and device == "cpu" and not upcast and onnx is None
        )
        if self.compiled_step is not None:
            self.linear_kernel = _compiled_linears(core.root / manifest.compiled[STEP].file)
            log.info(
                "linear layers on %s: the compiled step's, measured at export", prepack.describe(self.linear_kernel)
            )
        # The compiled step carries its own packed weights, the ONNX renditions theirs: the core's
        # are loaded only for a torch program that still needs them.
        needs_weights = (
            bool(onnx.torch_kinds) if onnx is not None else self.compiled_step is None or has_scored or bool(drafters)
        )
        # A quantized core's quantized weights come apart, as stored (quantized.prepare below).
        self.weights, stored = core.load_stored(device) if needs_weights else ({}, {})
        clock.lap("loading weights")
        kv_layout = manifest.kv
        if upcast:  # a 16-bit core on a host without native 16-bit matmuls: fp32 at load
            self.weights = {name: w.float() if w.is_floating_point() else w for name, w in self.weights.items()}
            kv_layout = msgspec.structs.replace(kv_layout, dtype="float32")
        # The executor builds every input itself, so per-call guard checks are skipped.
        torch_step = self.compiled_step is None and onnx is None
        portable_step = core.load_program(STEP, check_guards=False, fed=False) if torch_step else None
        self.step: Program | CompiledProgram | OnnxProgram = self.compiled_step or portable_step  # type: ignore[assignment]
        self.scored = (
            core.load_program(SCORED_PREFILL, check_guards=False, fed=False) if onnx is None and has_scored else None
        )
        if onnx is not None:
            self.step, self.scored = onnx.step, onnx.scored
        ported = {VISION: onnx.vision, **onnx.drafters} if onnx is not None else {}  # kind -> ONNX rendition
        # Vision cores: the vision program (run by engine/images.py's encoder, set up by the engine).
        self.vision = ported.get(VISION) or (
            core.load_program(VISION, check_guards=False) if VISION in manifest.programs else None
        )
        self.images = None  # helios.engine.images.ImageEncoder of a vision core
        self.drafters = {
            kind: ported.get(kind) or core.load_program(kind, check_guards=False, fed=False) for kind in drafters
        }
        self.keep_hidden = bool(drafters)
        # Host embedding tables: step input name -> its device row cache, filled before each program run.
        self.row_caches = embedding_rows.open_caches(core, device, row_cache, upcast)
        # The torch programs (graph rewrites, packing and quantized linears apply to these only).
        programs = [
            p
            for p in (portable_step, self.scored, *self.drafters.values())
            if p is not None and not isinstance(p, OnnxProgram)
        ]
        vision = self.vision if self.vision is not None and not isinstance(self.vision, OnnxProgram) else None
        for program in (*programs, vision) if vision is not None else programs:
            graph.place(program, device)  # device-neutral, once, on every device (graph.py)
        clock.lap(f"loading {len(programs) + (self.compiled_step is not None) + (onnx is not None)} programs")
        if upcast:
            for program in programs:
                graph.upcast(program)
        # Quantized weights: their linears rewritten onto the native kernels, or dequantized (any
        # device); before simplify and prepack, which leave the rewritten linears alone.
        self.weights, self.quantized = quantized.prepare(
            programs,
            self.weights,
            stored,
            device,
            upcast,
            manifest.quantization.level if manifest.quantization is not None else "",
            observed=(vision,) if vision is not None else (),
        )
        del stored
        if self.quantized is None and self.compiled_step is not None and manifest.quantization is not None:
            self.quantized = _compiled_quantized(manifest.quantization)
        if device == "cpu":
            for program in programs:
                graph.simplify(program)
            if prepack.available() and programs:
                self.linear_kernel = prepack.choose(programs, self.weights)
                self.weights = prepack.prepack(programs, self.weights, self.linear_kernel)
            clock.lap("simplifying graphs and packing weights")
        if onnx is not None:
            serial_decode_rows = 0  # ONNX Runtime keeps its own thread pool
        graphed = (
            cuda_graphs
            and device != "cpu"
            and portable_step is not None
            and graphs.GraphRunner.eligible(portable_step.input_names)
        )
        # with graphs, one page past the scheduler's pool: padded rows' scratch page (graphs.py)
        self.window_indexes = (
            frozenset(kv_layout.window_pool.caches) if kv_layout.window_pool is not None else frozenset()
        )
        self.num_window_pages = num_pages if num_window_pages is None else num_window_pages
        # Sequences carry window page tables (window_pages.py); else the main pool's pages serve both.
        self.pooled_windows = num_window_pages is not None and bool(self.window_indexes)
        self.kv = allocate_kv(
            kv_layout,
            num_pages + int(graphed),
            self.page_tokens,
            device,
            num_slots,
            self.num_window_pages + int(graphed),
        )
        self.num_slots = num_slots
        self._staging: Tensor | None = None  # host-store restores' payloads (write_pages)
        self.host_in_ns = self.host_in_bytes = 0  # time and bytes of host-store copy-ins (its cost estimate)
        self.state = self.kv[kv_layout.num_caches :]  # recurrent-state tensors [num_slots, ...] (hybrid cores)
        # (ONNX Runtime steps write and read the pages with their own kernels)
        self.packed_pages = (
            packed_pages and device == "cpu" and not kv_layout.shared_kv and runtime == onnx_runner.TORCH
        )
        self._kv_pairs = 2 * kv_layout.num_layers  # k0, v0, k1, v1, ... lead self.kv
        self._keep_packed()
        if self.kept_pairs:
            packed_mib = sum(t.numel() * t.element_size() for t in self.kv[: 2 * self.kept_pairs]) >> 20
            log.info(
                "packed KV pages: full pages of %d layers also kept in the attention kernel's layout "
                "(up to %d MiB more as pages fill; [server] packed_kv_pages = false turns it off)",
                self.kept_pairs,
                packed_mib,
            )
        clock.lap(f"allocating {num_pages} KV pages" + (f" and {num_slots} state slots" if self.state else ""))
        self.explicit = manifest.capabilities.explicit_logprob_ids
        self.threads = torch.get_num_threads()
        if device != "cpu":
            serial_decode_rows = 0
        elif serial_decode_rows is None:
            rows = tuple(r for r in threads.PROBE_ROWS if r <= self.probe_pages)  # the probe uses pages 0..rows-1
            serial_decode_rows = self._remembered(
                "thread-policy",
                f"{core.digest}|{self.step_kind}|{upcast}|{self.threads}|{rows}",
                lambda: threads.measure(self._probe_decode, self.threads, rows).serial_rows,
                "thread policy: decode steps of up to %d rows on one thread (measured before on this host)",
            )
            clock.lap("the thread policy")
        self.serial_decode_rows = serial_decode_rows
        self.launches = {"graph": 0, "eager": 0}  # program calls by kind (flare_graph_launches_total{kind})
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: events around program calls
        self.graphs: graphs.GraphRunner | None = None
        if graphed:
            self.graphs = graphs.GraphRunner(
                self.step,
                self.weights,
                self.kv,
                manifest.decode_buckets,
                self.page_tokens,
                -(-manifest.limits.max_model_len // self.page_tokens),
                num_pages,
                device,
                graphs.CudaGraphBackend(device),
                explicit_width=max(1, manifest.capabilities.max_top_logprobs)
                if "logprob_token_ids" in self.step.input_names
                else 0,
                window_scratch_page=self.num_window_pages,
            )
            log.info(
                "CUDA graphs: decode steps of up to %d rows replay a graph per bucket %s (captured at startup)",
                max(manifest.decode_buckets),
                sorted(manifest.decode_buckets),
            )

    def capture_graphs(self) -> dict[int, int]:
        """Capture the decode buckets' CUDA graphs (graphs.GraphRunner.capture_all) and return the
        device memory each took (measured; empty where capture failed: graphs are then off and every
        step runs eagerly, a warning says why)."""
        assert self.graphs is not None
        clock = Stopwatch(log, "CUDA graph capture")
        failure = self.graphs.capture_all()
        if failure is not None:
            log.warning("CUDA graphs: capture failed (%s); serving every step eagerly", failure)
            self.graphs = None
            return {}
        clock.lap(f"capturing {len(self.graphs.buckets)} decode buckets")
        return self.graphs.capture_bytes()

    @staticmethod
    def _remembered(kind: str, key: str, measure, found: str) -> int:
        """A host measurement of this core's step, taken once per core, step kind, thread count,
        OpenMP wait settings (they change the timings) and host; later starts reuse it. One taken
        while other processes kept the CPUs busy is used for this run only (threads.py)."""
        waits = (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
        key = f"{key}|{waits}|{host.fingerprint()}|{threads.METHOD}"
        remembered = hostcache.get(kind, key)
        if isinstance(remembered, int):
            log.info(found, remembered)
            return remembered
        value, quiet = threads.measured_on_a_quiet_host(measure)
        if quiet:
            hostcache.put(kind, key, value)
        else:
            log.warning(
                "%s: measured while other processes kept this host busy; used now, measured again at the next start",
                kind,
            )
        return value

    def speculation_rows(self, core: Core) -> int:
        """The row budget adaptive speculation keeps within (threads.measure_row_budget), measured
        once per core, step kind, thread count and host and remembered under ~/.cache/flare."""
        rows = tuple(r for r in threads.SPECULATION_ROWS if r <= self.probe_pages)  # the probe uses pages 0..rows-1
        return self._remembered(
            "speculation-rows",
            f"{core.digest}|{self.step_kind}|{self.threads}|{rows}",
            lambda: threads.measure_row_budget(self._probe_decode, rows),
            "speculation: up to %d decode rows per step (measured before on this host)",
        )

    @staticmethod
    def _compiled_step(core: Core, wanted: bool) -> tuple[CompiledProgram | None, str | None]:
        """(the compiled step, None) where it can run here; else (None, why not) or (None, None)
        when the core has none or it was not wanted."""
        spec = core.manifest.compiled.get(STEP)
        if spec is None or not wanted:
            return None, None
        reason = host.mismatch(spec.host)
        if reason is not None:
            return None, f"the core's compiled step does not run here: {reason}; serving the portable step"
        if _calls_native(core.root / spec.file) and not native.loaded():
            return None, (
                "the core's compiled step calls helios' native kernels, which are not loaded here "
                f"({native.status()}); serving the portable step"
            )
        try:
            return core.load_compiled(STEP, native.CompiledRunner if native.loaded() else None), None
        except (RuntimeError, OSError) as exc:  # a package that does not load is never fatal
            return None, f"the core's compiled step failed to load ({exc}); serving the portable step"

    @property
    def step_kind(self) -> str:
        if self.runtime == onnx_runner.ONNXRUNTIME:
            return onnx_runner.ONNXRUNTIME
        return "compiled" if self.compiled_step is not None else "portable"

    @property
    def probe_pages(self) -> int:
        """Pages every paged cache has (a probe's rows each take one)."""
        return min(int(t.shape[0]) for t in self.kv[: len(self.kv) - len(self.state)])

    def _probe_decode(self, rows: int) -> None:
        """One decode step of `rows` one-token sequences on pages 0..rows-1 (before serving); on CUDA
        it waits for the device, so the measurements time the step and not only its launch."""
        self._launch(self.step, self.probe_inputs(rows))
        if devices.is_cuda(self.device):
            torch.cuda.synchronize(self.device)

    def probe_inputs(self, rows: int) -> dict[str, Tensor]:
        """The step's inputs for `rows` one-token sequences on pages 0..rows-1 (results unread)."""
        inputs = {
            "token_ids": torch.zeros(rows, dtype=torch.int64),
            "positions": torch.zeros(rows, dtype=torch.int64),
            "slot_mapping": torch.arange(rows, dtype=torch.int64) * self.page_tokens,
            "block_tables": torch.arange(rows, dtype=torch.int32)[:, None],
            "seq_lens": torch.ones(rows, dtype=torch.int32),
            "query_start_loc": torch.arange(rows + 1, dtype=torch.int32),
            "logits_indices": torch.arange(rows, dtype=torch.int64),
        }
        if self.explicit:
            inputs["logprob_token_ids"] = torch.zeros(rows, 1, dtype=torch.int64)
        if self.state:  # the probe's results are never read: slots may repeat
            inputs["state_slots"] = torch.arange(rows, dtype=torch.int64) % self.num_slots
        if self.window_indexes:
            inputs["window_slot_mapping"], inputs["window_block_tables"] = (
                inputs["slot_mapping"],
                inputs["block_tables"],
            )
        if "image_features" in self.step.input_names:
            inputs.update(no_image_rows(self.step))
        if "attention_until" in self.step.input_names:
            inputs["attention_until"] = inputs["positions"]
        for name, cache in self.row_caches.items():
            inputs[name] = cache.zeros(rows)
        return {name: value.to(self.device) for name, value in inputs.items()}

    def _keep_packed(self) -> None:
        """(keys, values) cache pairs whose full pages the native attention keeps packed too."""
        self.kept_pairs = native.keep_packed(self.kv[: self._kv_pairs]) if self.packed_pages else 0

    def copy_page(self, src: int, dst: int) -> None:
        for tensor in self.page_caches:
            tensor[dst].copy_(tensor[src])
        if self.kept_pairs:
            native.forget_packed(self.page_caches, torch.tensor([dst]))

    def copy_window_page(self, src: int, dst: int) -> None:
        for tensor in self.window_caches:
            tensor[dst].copy_(tensor[src])
        if self.kept_pairs:
            native.forget_packed(self.window_caches, torch.tensor([dst]))

    @property
    def page_caches(self) -> list[Tensor]:
        """The main pool's paged cache tensors (with pooled windows, the window pool's are window_caches)."""
        paged = self.kv[: len(self.kv) - len(self.state)]
        return [t for i, t in enumerate(paged) if not (self.pooled_windows and i in self.window_indexes)]

    @property
    def window_caches(self) -> list[Tensor]:
        return [self.kv[i] for i in sorted(self.window_indexes)] if self.pooled_windows else []

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every paged cache tensor (a host-store record's payload)."""
        return sum(t[0].numel() * t.element_size() for t in self.page_caches)

    def read_pages(self, pages: list[int]) -> list[Tensor]:
        """Each page's bytes over every paged cache tensor, in cache order (uint8 copies)."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        rows = torch.cat(
            [t.index_select(0, index).reshape(len(pages), -1).view(torch.uint8) for t in self.page_caches], dim=1
        ).cpu()
        return [row.clone() for row in rows]

    def write_pages(self, writes: tuple[tuple[int, Tensor], ...]) -> None:
        """Store payloads read by read_pages (here or in an earlier process) into pages."""
        # Staged through one reused buffer of at most _STAGING_BYTES, a batch at a time: a fresh
        # buffer per restore paid the first touch of every byte (tens of MiB for a long prefix)
        # on the engine thread each time.
        batch = max(1, _STAGING_BYTES // self.page_bytes)
        if self._staging is None:
            self._staging = torch.empty(batch, self.page_bytes, dtype=torch.uint8)
        for start in range(0, len(writes), batch):
            part = writes[start : start + batch]
            index = torch.tensor([page for page, _ in part], dtype=torch.int64, device=self.device)
            rows = torch.stack([payload for _, payload in part], out=self._staging[: len(part)]).to(self.device)
            offset = 0
            for tensor in self.page_caches:
                width = tensor[0].numel() * tensor.element_size()
                values = (
                    rows[:, offset : offset + width].contiguous().view(tensor.dtype).view(len(part), *tensor.shape[1:])
                )
                tensor.index_copy_(0, index, values)
                offset += width
            if self.kept_pairs:
                native.forget_packed(self.page_caches, index)

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent-state slot over every state tensor (a host state record's payload)."""
        return sum(t[0].numel() * t.element_size() for t in self.state)

    def write_states(self, writes: tuple[tuple[int, Tensor], ...]) -> None:
        """Store host state records' payloads (every state tensor's slot, in order) into slots."""
        for slot, payload in writes:
            offset = 0
            for tensor in self.state:
                width = tensor[0].numel() * tensor.element_size()
                part = payload[offset : offset + width].to(self.device).view(tensor.dtype).view(tensor.shape[1:])
                tensor[slot].copy_(part)
                offset += width

    def copy_state(self, src: int, dst: int) -> None:
        for tensor in self.state:
            tensor[dst].copy_(tensor[src])

    def run(
        self, chunks: tuple[Chunk, ...], memory: MemoryPlan = NO_MEMORY_WORK, fed: Tensor | None = None
    ) -> StepResult:
        """Carry out the memory plan's work before the step (host restores into pages, state copies,
        host restores into state slots), run the chunks, then its copies after the step (forked
        children's pages and window pages, state slots), which read what the step has just written.
        fed: the previous step's sampled ids, still on the device; a token id -(1 + i) in a chunk
        stands for fed[i] (async output handling: helios.engine.overlap)."""
        self._timed.clear()  # device_time_ns counts this step's program calls (a failed step's are dropped)
        if memory.host_in:
            started = time.perf_counter_ns()
            self.write_pages(memory.host_in)  # type: ignore[arg-type]
            self.host_in_ns += time.perf_counter_ns() - started
            self.host_in_bytes += len(memory.host_in) * self.page_bytes
        for src, dst in memory.state_before:
            self.copy_state(src, dst)
        if memory.state_in:
            started = time.perf_counter_ns()
            self.write_states(memory.state_in)  # type: ignore[arg-type]
            self.host_in_ns += time.perf_counter_ns() - started
            self.host_in_bytes += len(memory.state_in) * self.state_bytes
        if self.serial_decode_rows:
            rows = sum(1 + len(c.draft_ids) for c in chunks)
            serial = rows <= self.serial_decode_rows and all(c.num_tokens == 1 for c in chunks)
            threads = 1 if serial else self.threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        replays = self.launches["graph"]
        plain = [c for c in chunks if not c.scored]
        scored = [c for c in chunks if c.scored]
        parts: list[tuple[list[Chunk], dict[str, Tensor]]] = []
        if plain:
            parts.append((plain, self._call(self.step, plain, scored=False, fed=fed)))
        if scored:
            assert self.scored is not None, "prompt logprobs need a core exported with --prompt-logprobs"
            parts.append((scored, self._call(self.scored, scored, scored=True)))
        for src, dst in memory.page_copies:
            self.copy_page(src, dst)
        for src, dst in memory.window_copies:
            self.copy_window_page(src, dst)
        for src, dst in memory.state_after:
            self.copy_state(src, dst)
        sampled: list[Chunk] = []
        rows: dict[str, list[Tensor]] = {}
        prompt_scores: dict[int, dict[str, Tensor]] = {}
        hidden: dict[int, Tensor] = {}
        for group, outputs in parts:
            sampled += [c for c in group if c.wants_logits]
            if self.keep_hidden and "hidden_states" in outputs:
                offset = 0
                for chunk in group:
                    width = chunk.num_tokens + len(chunk.draft_ids)
                    hidden[id(chunk)] = outputs["hidden_states"][offset : offset + width]
                    offset += width
            for name in ("logits", "logsumexp", "top_logprobs", "top_ids", "explicit_logprobs"):
                if name in outputs:
                    rows.setdefault(name, []).append(outputs[name])
            if "prompt_logprobs" in outputs:
                offset = 0
                for chunk in group:
                    prompt_scores[id(chunk)] = {
                        name: outputs[name][offset : offset + chunk.num_tokens]
                        for name in ("prompt_logprobs", "prompt_ranks", "prompt_top_logprobs", "prompt_top_ids")
                        if name in outputs
                    }
                    offset += chunk.num_tokens
        # One program's rows are used as they are (a fresh output of its call; at 64 rows the logits
        # alone are 12.6 MB, a copy and its page faults each step); a graph replay's are copied out
        # of the bucket's static buffers, which the next replay overwrites.
        replayed = self.launches["graph"] != replays
        cat = {
            name: values[0] if len(values) == 1 and not replayed else torch.cat(values) for name, values in rows.items()
        }
        return StepResult(
            sampled=tuple(sampled),
            logits=cat["logits"],
            logsumexp=cat["logsumexp"],
            top_logprobs=cat.get("top_logprobs"),
            top_ids=cat.get("top_ids"),
            explicit_logprobs=cat.get("explicit_logprobs"),
            prompt_scores=prompt_scores,
            hidden=hidden,
        )

    def _call(self, program, chunks: list[Chunk], scored: bool, fed: Tensor | None = None) -> dict[str, Tensor]:
        size = self.page_tokens
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        targets: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        explicit: list[tuple[int, ...]] = []
        for chunk in chunks:
            seq, drafts = chunk.seq, chunk.draft_ids
            end = chunk.start + chunk.num_tokens + len(drafts)  # drafts follow the chunk's last token
            table = seq.pages
            token_ids += seq.token_ids[chunk.start : chunk.start + chunk.num_tokens]
            token_ids += drafts
            span = range(chunk.start, end)
            positions += span
            slots += [table[p // size] * size + p % size for p in span]
            if scored:
                targets += [seq.token_ids[p + 1] if p + 1 < seq.num_prompt else -1 for p in span]
            seq_lens.append(end)
            starts.append(starts[-1] + end - chunk.start)
            if chunk.wants_logits:  # the last token's row, then every draft's (verification)
                logits_rows += range(starts[-1] - chunk.num_rows, starts[-1])
                explicit += [seq.request.logprob_token_ids or (0,)] * chunk.num_rows
        # The programs' input keeps the core format's name, "block_tables": one page table per row.
        width = max(len(c.seq.pages) for c in chunks)
        tables = torch.zeros((len(chunks), width), dtype=torch.int32)
        for row, chunk in enumerate(chunks):
            tables[row, : len(chunk.seq.pages)] = torch.tensor(chunk.seq.pages, dtype=torch.int32)
        if not logits_rows:  # the program always returns at least one row; it is ignored
            logits_rows, explicit = [starts[-1] - 1], [(0,)]
        num_logits_rows = len(logits_rows)
        if self.device == "cpu":  # no logits row reduced alone (rows.py): copies of the last, dropped
            extra = padded(num_logits_rows) - num_logits_rows
            logits_rows += [logits_rows[-1]] * extra
            explicit += [explicit[-1]] * extra
        inputs = {
            "token_ids": torch.tensor(token_ids, dtype=torch.int64),
            "positions": torch.tensor(positions, dtype=torch.int64),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "block_tables": tables,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32),
            "logits_indices": torch.tensor(logits_rows, dtype=torch.int64),
        }
        if self.explicit:
            k = max(len(ids) for ids in explicit)
            inputs["logprob_token_ids"] = torch.tensor([list(ids) + [0] * (k - len(ids)) for ids in explicit])
        if scored:
            inputs["target_ids"] = torch.tensor(targets, dtype=torch.int64)
        if "image_features" in program.input_names:  # vision cores: the rows whose embeddings are image features
            inputs.update(self.images.step_inputs(chunks, starts[:-1]) if self.images else no_image_rows(program))
        if (
            "attention_until" in program.input_names
        ):  # an image's tokens see the rest of it (helios/core/ops/bidirectional.py)
            inputs["attention_until"] = _attention_until(chunks, positions)
        if self.state:
            inputs["state_slots"] = torch.tensor([c.seq.state_slot for c in chunks], dtype=torch.int64)
        if "window_slot_mapping" in program.input_names:
            inputs["window_slot_mapping"], inputs["window_block_tables"] = self._window_inputs(chunks, positions, width)
        for name, cache in self.row_caches.items():  # host tables' rows, from the device row cache
            if name in program.input_names:
                inputs[name] = cache.gather(inputs["token_ids"], inputs.get("image_rows"))
        inputs = {name: value.to(self.device) for name, value in inputs.items()}
        if fed is not None:  # placeholders -(1 + i) take the previous step's i-th sampled id, on the device
            ids = inputs["token_ids"]
            inputs["token_ids"] = torch.where(ids < 0, fed[(-1 - ids).clamp_(min=0)], ids)
        timer = self._start_timer()
        outputs = None
        if (
            self.graphs is not None
            and program is self.step
            and all(c.num_tokens == 1 and not c.draft_ids and c.wants_logits for c in chunks)
        ):
            outputs = self.graphs.run(inputs)  # None: no bucket holds the step
        if outputs is None:
            outputs = self._launch(program, inputs)
            self.launches["eager"] += 1
        else:
            self.launches["graph"] += 1
        if timer is not None:
            timer[1].record()
            self._timed.append(timer)
        # Per-row outputs: only the rows asked for (none when no chunk wants logits).
        per_token = ("prompt_logprobs", "prompt_ranks", "prompt_top_logprobs", "prompt_top_ids", "hidden_states")
        kept = num_logits_rows if any(c.wants_logits for c in chunks) else 0
        outputs = {k: v[:kept] if k not in per_token else v for k, v in outputs.items()}
        if not self.keep_hidden:
            outputs.pop("hidden_states", None)
        # Every output stays on the device: the engine samples there and copies what the host reads
        # once (step_output.fetch); the drafter's programs read the hidden states there. A graph's
        # outputs are views of its bucket's static buffers, valid until the next replay: the engine
        # reads them within the step.
        return outputs

    def _start_timer(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """CUDA: a pair of timing events, the first recorded now (before a program call); None elsewhere."""
        if not devices.is_cuda(self.device):
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # not yet run on a GPU (docs/performance.md, Device check)
        return start, end

    def take_timers(self) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """This step's timing events (CUDA), handed over before the next step starts new ones."""
        timed, self._timed = self._timed, []
        return timed

    def device_time_ns(self, timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None) -> int | None:
        """CUDA: the device's nanoseconds in this step's program calls (or in `timed`, from
        take_timers), from their events (waits for the last one; the step's copy to the host has
        already); None on other devices, whose steps are timed on the host (api.md replay_gpu_ns)."""
        if not devices.is_cuda(self.device):
            return None
        timed = self.take_timers() if timed is None else timed
        total = 0
        for start, end in timed:
            end.synchronize()
            total += int(start.elapsed_time(end) * 1e6)  # elapsed_time is in milliseconds
        return total

    def _launch(self, program, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """One eager program call on this executor's weights and caches (a tensor-parallel rank 0
        sends it to the other ranks first: helios.engine.parallel.proxy)."""
        return program(self.weights, self.kv, **inputs)

    def _window_inputs(self, chunks: list[Chunk], positions: list[int], width: int) -> tuple[Tensor, Tensor]:
        """The window pool's slots of the step's positions and its page tables (window_pages.py): a
        reclaimed entry (-1) is sent as page 0, which no query reads (it is behind every window).
        Without pooled windows (num_window_pages not given), the main pool's pages serve both."""
        size = self.page_tokens
        slots: list[int] = []
        tables = torch.zeros((len(chunks), width), dtype=torch.int32)
        offset = 0
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            table = seq.window_pages if self.pooled_windows else seq.pages
            assert len(table) <= width, "a window page table is longer than the step's tables"
            count = chunk.num_tokens + len(chunk.draft_ids)
            for p in positions[offset : offset + count]:
                page = table[p // size]
                assert page >= 0, f"position {p} has no window page"
                slots.append(page * size + p % size)
            offset += count
            tables[row, : len(table)] = torch.tensor([max(0, page) for page in table], dtype=torch.int32)
        return torch.tensor(slots, dtype=torch.int64), tables

    def widen(self, index: int, extra_pages: int) -> Tensor:
        """Give paged cache `index` `extra_pages` scratch pages past the pool (ids num_pages..):
        returns the widened tensor; the step programs keep seeing the pool's pages only (a view).
        A drafter writes its speculative rows there where a sequence has no page yet."""
        old = self.kv[index]
        wide = torch.zeros((old.shape[0] + extra_pages, *old.shape[1:]), dtype=old.dtype, device=old.device)
        wide[: old.shape[0]].copy_(old)
        self.kv[index] = wide[: old.shape[0]]
        self._keep_packed()  # the pair this cache belongs to, now over the wider tensor
        return wide
