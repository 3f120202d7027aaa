"""CUDA graphs for decode-only steps: one captured step per decode bucket of the core.

The logic (which bucket a step uses, the static input buffers, how padding rows are filled,
copying a step's inputs in, slicing the outputs back to the real rows) is GraphRunner's and
runs the same on every backend. A backend only captures a callable on those static buffers
and replays it:

* EagerBackend, the CPU test double: "capture" records the callable, "replay" calls it on the
  static buffers (CI checks the whole runner on CPU with it, tests/engine/test_graphs.py);
* CudaGraphBackend: torch.cuda.CUDAGraph, one private memory pool per bucket, captured after
  warm-up runs on a side stream. NOT YET RUN ON A GPU: no GPU machine was available when it was
  written; docs/serving.md says what a GPU session must still check.

Padding never touches a real KV page: the pool is allocated one page larger than the pages the
scheduler hands out, and that last page is the runner's scratch page. A padded row is one token
(id 0, position 0) that writes its keys and values to the scratch page's first slot, whose block
table names only the scratch page and whose sequence length is 1: it reads only what padded rows
wrote. Real rows' block tables are padded to the static width with the scratch page as well,
past their sequence length, where attention reads nothing.

Graphs are captured at startup (capture_all, after any drafter has widened the caches); a
cache tensor replaced later makes the runner recapture on first use.

Steps the runner declines (prefill, mixed, verification and draft steps, more rows than the
largest bucket, more explicit logprob ids than the static width) run eagerly; the executor
counts both kinds (flare_graph_launches_total{kind}).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from helios.core.manifest import Manifest

# Inputs a graph-captured step may take; a program with any other input (recurrent state slots,
# image features) runs eagerly: its decode inputs are not all static-shaped or idempotent.
GRAPH_INPUTS = frozenset(
    {
        "token_ids",
        "positions",
        "slot_mapping",
        "block_tables",
        "seq_lens",
        "query_start_loc",
        "logits_indices",
        "logprob_token_ids",
        "window_slot_mapping",
        "window_block_tables",
    }
)
KEEP_ON_DEVICE = frozenset({"hidden_states"})  # outputs the executor keeps on the device: copied out of the graph's


class GraphBackend(Protocol):
    """Captures a step callable for a bucket and replays it; outputs live in static storage."""

    def capture(self, bucket: int, step: Callable[[], dict[str, Tensor]]) -> None: ...

    def replay(self, bucket: int) -> dict[str, Tensor]: ...

    def captured(self, bucket: int) -> bool: ...

    def capture_bytes(self) -> dict[int, int]: ...


class EagerBackend:
    """The CPU test double: capture records the callable, replay calls it (on the static buffers)."""

    def __init__(self) -> None:
        self.steps: dict[int, Callable[[], dict[str, Tensor]]] = {}
        self.captures = 0

    def capture(self, bucket: int, step: Callable[[], dict[str, Tensor]]) -> None:
        self.steps[bucket] = step
        self.captures += 1

    def replay(self, bucket: int) -> dict[str, Tensor]:
        return self.steps[bucket]()

    def captured(self, bucket: int) -> bool:
        return bucket in self.steps

    def capture_bytes(self) -> dict[int, int]:
        return {}  # nothing held on the side: the replay is the eager call


class CudaGraphBackend:  # pragma: no cover - needs a GPU; not yet run on one (see the module docstring)
    """torch.cuda.CUDAGraph per bucket, each in its own memory pool, captured after `warmup`
    eager runs on a side stream (allocator and kernel autotuning settle before capture). The
    warm-up runs write the step's keys and values exactly as the replay does (the same values
    to the same slots), so capturing on a live step is harmless for cores without recurrent state.
    Each capture's device memory is measured: torch.cuda.memory_reserved before and after it."""

    def __init__(self, device: str, warmup: int = 2) -> None:
        self.device = torch.device(device)
        self.warmup = warmup
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}
        self.measured: dict[int, int] = {}  # bucket -> bytes its warm-up and capture reserved

    def capture_bytes(self) -> dict[int, int]:
        return dict(self.measured)

    def capture(self, bucket: int, step: Callable[[], dict[str, Tensor]]) -> None:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        self._capture(bucket, step)
        torch.cuda.synchronize(self.device)
        self.measured[bucket] = max(0, torch.cuda.memory_reserved(self.device) - before)

    def _capture(self, bucket: int, step: Callable[[], dict[str, Tensor]]) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            outputs = step()
        self.graphs[bucket] = (graph, outputs)

    def replay(self, bucket: int) -> dict[str, Tensor]:
        graph, outputs = self.graphs[bucket]
        graph.replay()
        return outputs

    def captured(self, bucket: int) -> bool:
        return bucket in self.graphs


class GraphRunner:
    """Decode-only steps through static buffers of the smallest decode bucket that holds them.

    program(weights, kv, **inputs) is the step; kv's paged caches must have `scratch_page` (the
    page past the scheduler's pool) for padded rows. max_blocks: the block tables' static width
    (pages of the longest sequence). explicit_width: the static width of logprob_token_ids
    (0 when the program has no such input). window_scratch_page: a window-pool core's scratch page in
    the window caches (window_slot_mapping / window_block_tables are padded like the main ones)."""

    def __init__(
        self,
        program,
        weights: dict[str, Tensor],
        kv: list[Tensor],
        buckets: tuple[int, ...],
        page_tokens: int,
        max_blocks: int,
        scratch_page: int,
        device: str,
        backend: GraphBackend,
        explicit_width: int = 0,
        window_scratch_page: int | None = None,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"decode buckets must be positive batch sizes, got {buckets!r}")
        if "logprob_token_ids" in program.input_names and explicit_width < 1:
            raise ValueError("a step taking logprob_token_ids needs a static explicit_width of at least 1")
        self.program, self.weights, self.kv = program, weights, kv
        self.buckets = tuple(sorted(set(buckets)))
        self.page_tokens, self.max_blocks, self.scratch_page = page_tokens, max_blocks, scratch_page
        self.window_scratch_page = scratch_page if window_scratch_page is None else window_scratch_page
        self.device, self.backend, self.explicit_width = device, backend, explicit_width
        self.static: dict[int, dict[str, Tensor]] = {}
        self._kv_identity: tuple[int, ...] = self._identity()

    @classmethod
    def for_core(
        cls,
        manifest: Manifest,
        program,
        weights: dict[str, Tensor],
        kv: list[Tensor],
        page_tokens: int,
        scratch_page: int,
        device: str,
        backend: GraphBackend,
        *,
        buckets: tuple[int, ...] | None = None,
        window_scratch_page: int | None = None,
    ) -> GraphRunner:
        """The runner of a core's step: its decode buckets (unless `buckets`), block tables as wide
        as its longest sequence, logprob_token_ids as wide as its top-logprobs limit."""
        return cls(
            program,
            weights,
            kv,
            manifest.decode_buckets if buckets is None else buckets,
            page_tokens,
            -(-manifest.limits.max_model_len // page_tokens),
            scratch_page,
            device,
            backend,
            max(1, manifest.capabilities.max_top_logprobs) if "logprob_token_ids" in program.input_names else 0,
            window_scratch_page,
        )

    @staticmethod
    def eligible(input_names: tuple[str, ...]) -> bool:
        return set(input_names) <= GRAPH_INPUTS

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket of at least `rows` rows; None above the largest (the step runs eagerly)."""
        index = bisect.bisect_left(self.buckets, rows)
        return self.buckets[index] if rows >= 1 and index < len(self.buckets) else None

    def buffers(self, bucket: int) -> dict[str, Tensor]:
        """The bucket's static inputs, filled as all-padding rows (made on first use)."""
        if bucket not in self.static:
            on = {"device": self.device}
            scratch_slot = self.scratch_page * self.page_tokens
            static = {
                "token_ids": torch.zeros(bucket, dtype=torch.int64, **on),
                "positions": torch.zeros(bucket, dtype=torch.int64, **on),
                "slot_mapping": torch.full((bucket,), scratch_slot, dtype=torch.int64, **on),
                "block_tables": torch.full((bucket, self.max_blocks), self.scratch_page, dtype=torch.int32, **on),
                "seq_lens": torch.ones(bucket, dtype=torch.int32, **on),
                # one token per row, padding rows included: fixed for every decode step of the bucket
                "query_start_loc": torch.arange(bucket + 1, dtype=torch.int32, **on),
                "logits_indices": torch.arange(bucket, dtype=torch.int64, **on),
            }
            if self.explicit_width:
                static["logprob_token_ids"] = torch.zeros(bucket, self.explicit_width, dtype=torch.int64, **on)
            window = self.window_scratch_page
            static["window_slot_mapping"] = torch.full((bucket,), window * self.page_tokens, dtype=torch.int64, **on)
            static["window_block_tables"] = torch.full((bucket, self.max_blocks), window, dtype=torch.int32, **on)
            self.static[bucket] = {name: static[name] for name in self.program.input_names}
        return self.static[bucket]

    def capture_all(self) -> str | None:
        """Capture every bucket's step now, largest first, on all-padding buffers (they write only the
        scratch page, so this is safe before serving). Returns None, or why capturing failed (the
        caller then runs every step eagerly: with the pure-torch reference ops, which read sequence
        lengths on the host, a CUDA capture is expected to fail until capturable CUDA kernels exist)."""
        try:
            for bucket in reversed(self.buckets):
                static = self.buffers(bucket)
                if not self.backend.captured(bucket):
                    self.backend.capture(bucket, self._step_on(static))
        except RuntimeError as exc:  # torch raises RuntimeError (incl. torch.cuda errors) for capture failures
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
        return None

    def capture_bytes(self) -> dict[int, int]:
        """Device memory each captured bucket took (measured by the backend; empty for the CPU double)."""
        return self.backend.capture_bytes()

    def _step_on(self, static: dict[str, Tensor]) -> Callable[[], dict[str, Tensor]]:
        return lambda: self.program(self.weights, self.kv, **static)

    def fits(self, inputs: dict[str, Tensor]) -> int | None:
        """The bucket for a decode-only step's eager inputs (one token per row), or None: eager."""
        rows = int(inputs["seq_lens"].shape[0])
        if int(inputs["token_ids"].shape[0]) != rows or int(inputs["logits_indices"].shape[0]) != rows:
            return None
        if any(
            int(inputs[name].shape[1]) > self.max_blocks
            for name in ("block_tables", "window_block_tables")
            if name in inputs
        ):
            return None
        explicit = inputs.get("logprob_token_ids")
        if explicit is not None and int(explicit.shape[1]) > self.explicit_width:
            return None
        return self.bucket_for(rows)

    def copy_in(self, bucket: int, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Write a step's inputs into the bucket's static buffers; padding rows (and the padded part
        of each real row's block table) get the scratch values back."""
        static = self.buffers(bucket)
        rows = int(inputs["seq_lens"].shape[0])
        width = int(inputs["block_tables"].shape[1])
        for name in ("token_ids", "positions", "slot_mapping", "seq_lens"):
            static[name][:rows].copy_(inputs[name])
        static["token_ids"][rows:].zero_()
        static["positions"][rows:].zero_()
        static["slot_mapping"][rows:].fill_(self.scratch_page * self.page_tokens)
        static["seq_lens"][rows:].fill_(1)
        tables = static["block_tables"]
        tables[:rows, :width].copy_(inputs["block_tables"])
        tables[:rows, width:].fill_(self.scratch_page)
        tables[rows:].fill_(self.scratch_page)
        if "window_slot_mapping" in static:  # the window pool's, padded with its own scratch page
            window = self.window_scratch_page
            static["window_slot_mapping"][:rows].copy_(inputs["window_slot_mapping"])
            static["window_slot_mapping"][rows:].fill_(window * self.page_tokens)
            tables, width = static["window_block_tables"], int(inputs["window_block_tables"].shape[1])
            tables[:rows, :width].copy_(inputs["window_block_tables"])
            tables[:rows, width:].fill_(window)
            tables[rows:].fill_(window)
        if "logprob_token_ids" in static:
            k = int(inputs["logprob_token_ids"].shape[1])
            static["logprob_token_ids"].zero_()
            static["logprob_token_ids"][:rows, :k].copy_(inputs["logprob_token_ids"])
        return static

    def run(self, inputs: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """The step's outputs for its real rows, from the bucket's graph (captured on first use);
        None when the step does not fit a bucket (the caller runs it eagerly)."""
        bucket = self.fits(inputs)
        if bucket is None:
            return None
        rows = int(inputs["seq_lens"].shape[0])
        static = self.copy_in(bucket, inputs)
        if self._identity() != self._kv_identity:  # a cache tensor was replaced (widened): graphs are stale
            self.backend = (
                type(self.backend)() if isinstance(self.backend, EagerBackend) else CudaGraphBackend(self.device)
            )
            self._kv_identity = self._identity()
        if not self.backend.captured(bucket):
            self.backend.capture(bucket, self._step_on(static))
        outputs = self.backend.replay(bucket)
        width = int(inputs["logprob_token_ids"].shape[1]) if "logprob_token_ids" in inputs else None
        sliced = {}
        for name, value in outputs.items():
            part = value[:rows]
            if name == "explicit_logprobs" and width is not None:
                part = part[:, :width]
            sliced[name] = part.clone() if name in KEEP_ON_DEVICE else part
        return sliced

    def _identity(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.kv)
