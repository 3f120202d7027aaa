"""The one place that reads helios' configuration: the TOML file, CLI flags, key file.

`[server]` table keys (all optional):
  api_key, host, port, max_body_bytes, max_concurrency, queue_size, http_slots,
  default_max_tokens, prefill_chunk_size, kv_pages, kv_memory_mb, thinking_token_budget,
  aliases, frontend_workers, prefix_cache, grammar_threads, serial_decode_rows, compiled_step, drain_seconds,
  header_timeout_seconds, body_timeout_seconds, grammar_memory_mb, grammar_cache_mb, grammar_workers,
  speculation, max_draft_tokens, speculative_rows, history_drafts, learned_drafts, draft_core, state_snapshots,
  snapshot_interval, anchor_guards, checkpoint_work_fraction, host_cache, host_cache_memory_mb, host_cache_disk_mb, host_cache_dir,
  host_cache_copy_queue_mb, device, cuda_graphs, kv_memory_fraction, window_pool, packed_kv_pages, image_cache_mb,
  embedding_row_cache_rows, embedding_rows_source, runtime

`[parallel]` table keys (all optional; docs/parallel.md): tensor, expert, timeout_s, nnodes, node_rank,
  master_addr, master_port, headless
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

MIB = 1 << 20


class ConfigError(ValueError):
    """An invalid setting; the message names it and says what is accepted."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor/expert parallel serving ([parallel]; `helios serve --tensor-parallel N ...` overrides)."""

    tensor: int = 1  # ranks (one process each); the core must declare the size (ignition export --tensor-parallel)
    expert: bool = False  # MoE cores exported with --expert-parallel: experts split across the ranks
    timeout_s: float = 60.0  # rendezvous and every collective's deadline
    nnodes: int = 1  # machines; each runs tensor / nnodes ranks
    node_rank: int = 0  # this machine's index (0 serves HTTP)
    master_addr: str = "127.0.0.1"  # node 0's address, where rank 0's rendezvous listens
    master_port: int = 29500
    headless: bool = False  # a machine other than node 0: run its ranks, serve no HTTP


@dataclass(frozen=True, slots=True)
class ServerConfig:
    api_key: str | None = None  # None or "": authentication disabled
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * MIB  # bound on encoded and decoded request bodies
    max_concurrency: int = 64  # live generations (choices) in the engine
    queue_size: int = 256  # requests waiting for engine admission; beyond: 503
    http_slots: int = 512  # concurrent HTTP generation requests (one slot per choice); beyond: 429
    default_max_tokens: int | None = None  # None: the remaining context
    prefill_chunk_size: int = 512  # prefill tokens per engine step
    kv_pages: int | None = None  # KV pool size in pages; None: from kv_memory_mb
    # KV pool size in MiB; None: 1024 on CPU, on CUDA kv_memory_fraction of the device memory free
    # after the weights, less the CUDA graphs' reserve (helios.engine.devices.kv_pages_for)
    kv_memory_mb: int | None = None
    kv_memory_fraction: float = 0.9
    # "auto" (CUDA when torch sees a device, else cpu), "cpu", "cuda" or "cuda:N" (resolved at startup:
    # helios.engine.devices.resolve). cuda_graphs: on CUDA, decode-only steps replay a CUDA graph
    # captured per decode bucket of the core (helios.engine.graphs); ignored on CPU.
    device: str = "auto"
    cuda_graphs: bool = True
    thinking_token_budget: int | None = None  # default reasoning-token cap (state.py checks the core can cut)
    aliases: tuple[str, ...] = ()  # extra model names; the first nonempty is the public id
    frontend_workers: int = 4  # threads for decompression and tokenization
    prefix_cache: bool = True
    # Cores whose sliding-window layers keep their caches in a window pool: free those pages behind
    # the window (helios.engine.memory.window_pages); false serves both tables from the one pool.
    window_pool: bool = True
    # CPU, bfloat16 caches on AVX512-BF16: keep each full KV page also in the attention kernel's tile
    # layout (helios/engine/native/packed_pages.cpp): decode reads it instead of repacking the history
    # every step, at up to twice the KV pool's memory; false keeps one copy.
    packed_kv_pages: bool = True
    # Vision cores: memory for decoded images (frontend) and, separately, for prepared image
    # features (engine), each kept by image digest so a repeated image is neither decoded nor
    # encoded again; 0 turns both off.
    image_cache_mb: int = 256
    # Cores exported with --host-embeddings (Gemma 4's per-layer input table kept off the device): the
    # device keeps up to embedding_row_cache_rows rows of each such table, least recently used out
    # (0: none, every step's rows are read from the host); missed rows are read from the table in RAM
    # ("ram": read at startup) or through a memory map of the core's weights file ("disk": no resident
    # copy, the page cache or the disk serves each read). Other cores ignore both (engine/memory/embedding_rows.py).
    embedding_row_cache_rows: int = 8192
    embedding_rows_source: str = "ram"
    # Threads computing a step's grammar masks. On CPU serving torch owns every core and a
    # second spinning pool slows each step many times over; raise it on GPU hosts.
    grammar_threads: int = 1
    # CPU: decode-only steps of at most this many sequences run on one thread. They are
    # memory-bound, so on some machines a second thread adds little, and a thread pool
    # sharing a small machine with the HTTP side stalls whenever one of its threads is
    # preempted; on others every thread helps. 0: every step uses all of torch's threads.
    serial_decode_rows: int | None = None  # None: measured at startup (helios.engine.threads)
    # Run the core's compiled step (ignition export --compile-step) where it was built for
    # this host's CPU and torch; elsewhere, or when false, the portable step.
    compiled_step: bool = True
    # "torch" (the core's torch.export programs) or "onnxruntime" (its ONNX renditions, from
    # `ignition export --onnx`, on ONNX Runtime's CPU provider; helios.engine.onnx_runner).
    runtime: str = "torch"
    # On SIGTERM/SIGINT: new requests get 503, open ones get this long to finish, then end
    # with an error event (streams) or a 500 (buffered) and the process exits.
    drain_seconds: float = 30.0
    # Slow clients: a request's headers must arrive within header_timeout_seconds of its
    # first byte, and its body within body_timeout_seconds (else the connection closes / 408).
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 60.0
    # Grammars (structured output, custom tools) are first compiled in worker processes:
    # one compiled grammar may hold at most grammar_memory_mb, the cache grammar_cache_mb.
    grammar_memory_mb: int = 128
    grammar_cache_mb: int = 512
    grammar_workers: int = 1
    # Speculative decoding from the history drafter (helios.engine.speculation.drafter): "adaptive" offers
    # each sequence as many drafts as its recent acceptance earns, up to max_draft_tokens, and
    # none once a step's decode rows reach speculative_rows (compute-bound: drafts would only
    # cost; measured at startup unless set); "fixed" always offers max_draft_tokens; "off" decodes one
    # token at a time.
    # history_drafts: also draft from recent outputs of other requests (same cache identity).
    # Learned drafts (helios.engine.speculation.mtp, helios.engine.speculation.draft_core): draft_core names a small core
    # with the same tokenizer that proposes drafts (--draft-core overrides it); without one, a core
    # carrying MTP programs drafts with them. learned_drafts = false keeps only history drafts.
    speculation: str = "adaptive"
    max_draft_tokens: int = 6
    speculative_rows: int | None = None  # None: measured at startup (helios.engine.threads.measure_row_budget)
    history_drafts: bool = True
    learned_drafts: bool = True
    draft_core: str | None = None
    # Hybrid cores (recurrent layers): prefix reuse resumes from state snapshots taken during
    # prefill at multiples of snapshot_interval prompt tokens (rounded up to whole pages; None:
    # the prefill chunk size) and at each prompt's last page boundary; state_snapshots of them
    # are kept, least recently used out (None: max_concurrency; 0: no prefix reuse for hybrids).
    state_snapshots: int | None = None
    snapshot_interval: int | None = None
    # Of the state_snapshots slots, this many are kept for conversation anchors: other captures
    # take a free slot only beyond the unused guards (None: a quarter of state_snapshots).
    anchor_guards: int | None = None
    # Hybrid cores also snapshot where the prompt's structure hints (the conversation anchor, the
    # last few message ends, Anthropic cache_control block ends). Such a snapshot off those planned
    # boundaries ends a prefill chunk early and copies the state; the predicted extra work a request
    # may spend on them is this fraction of its predicted prefill time (0: none).
    checkpoint_work_fraction: float = 0.05
    # The host prefix store (helios.engine.memory.host_store): finished prefixes' KV pages kept beyond
    # the page pool in memory (host_cache_memory_mb; None: an eighth of the memory available at
    # startup, at most 4 GiB) and on disk (host_cache_disk_mb in host_cache_dir, one directory
    # per core; None: $FLARE_PREFIX_CACHE_DIR, else ~/.cache/flare/prefix), so a restarted
    # server reuses yesterday's prefixes. host_cache = false turns both tiers off;
    # host_cache_disk_mb = 0 only the disk tier. host_cache_copy_queue_mb bounds the KV pages pinned
    # for the copy-out thread (beyond it, while the copier is behind, a finishing chain's end is dropped).
    # Vision cores keep their images' prepared inputs in these tiers too (frontend/image_cache.py:
    # in memory also within image_cache_mb, on disk in a record directory of their own).
    host_cache: bool = True
    host_cache_copy_queue_mb: int = 256
    host_cache_memory_mb: int | None = None
    host_cache_disk_mb: int = 4096
    host_cache_dir: str | None = None
    parallel: ParallelConfig = ParallelConfig()  # the [parallel] table

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_key)


_POSITIVE = (
    "port",
    "max_body_bytes",
    "max_concurrency",
    "queue_size",
    "http_slots",
    "prefill_chunk_size",
    "frontend_workers",
    "grammar_threads",
    "grammar_memory_mb",
    "grammar_cache_mb",
    "grammar_workers",
    "max_draft_tokens",
    "host_cache_copy_queue_mb",
)
_OPTIONAL_POSITIVE = (
    "default_max_tokens",
    "kv_pages",
    "kv_memory_mb",
    "thinking_token_budget",
    "speculative_rows",
    "host_cache_memory_mb",
)


def _check(config: ServerConfig) -> ServerConfig:
    for name in _POSITIVE + _OPTIONAL_POSITIVE:
        value = getattr(config, name)
        if value is None and name in _OPTIONAL_POSITIVE:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"[server] {name} must be a positive integer, got {value!r}")
    if config.port > 65535:
        raise ConfigError(f"[server] port must be at most 65535, got {config.port}")
    if config.thinking_token_budget is not None and config.thinking_token_budget >= 1 << 31:
        raise ConfigError("[server] thinking_token_budget must be a positive 32-bit integer")
    if config.api_key is not None and not isinstance(config.api_key, str):
        raise ConfigError("[server] api_key must be a string")
    if not isinstance(config.host, str) or not config.host:
        raise ConfigError("[server] host must be a nonempty string")
    if config.host_cache_dir is not None and (not isinstance(config.host_cache_dir, str) or not config.host_cache_dir):
        raise ConfigError("[server] host_cache_dir must be a nonempty path string")
    if not all(isinstance(a, str) for a in config.aliases):
        raise ConfigError("[server] aliases must be a list of strings")
    if config.speculation not in ("adaptive", "fixed", "off"):
        raise ConfigError(f"[server] speculation must be adaptive, fixed or off, got {config.speculation!r}")
    if config.draft_core is not None and (not isinstance(config.draft_core, str) or not config.draft_core):
        raise ConfigError("[server] draft_core must be a nonempty path string (a core directory)")
    if not isinstance(config.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f'[server] device must be "auto", "cpu", "cuda" or "cuda:N", got {config.device!r}')
    if config.runtime not in ("torch", "onnxruntime"):
        raise ConfigError(f'[server] runtime must be "torch" or "onnxruntime", got {config.runtime!r}')
    if config.runtime == "onnxruntime" and config.parallel.tensor > 1:
        raise ConfigError('[server] runtime = "onnxruntime" serves one rank: drop [parallel] tensor or use "torch"')
    share = config.kv_memory_fraction
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError(f"[server] kv_memory_fraction must be a number above 0 and at most 1, got {share!r}")
    for name in (
        "prefix_cache",
        "compiled_step",
        "history_drafts",
        "learned_drafts",
        "host_cache",
        "cuda_graphs",
        "window_pool",
        "packed_kv_pages",
    ):
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"[server] {name} must be true or false")
    for name in ("drain_seconds", "header_timeout_seconds", "body_timeout_seconds"):
        seconds = getattr(config, name)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 3600:
            raise ConfigError(f"[server] {name} must be a number of seconds above 0 and at most 3600, got {seconds!r}")
    for name in (
        "state_snapshots",
        "snapshot_interval",
        "anchor_guards",
        "host_cache_disk_mb",
        "image_cache_mb",
        "embedding_row_cache_rows",
    ):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ConfigError(f"[server] {name} must be a non-negative integer, got {value!r}")
    if config.embedding_rows_source not in ("ram", "disk"):
        raise ConfigError(
            f'[server] embedding_rows_source must be "ram" or "disk", got {config.embedding_rows_source!r}'
        )
    fraction = config.checkpoint_work_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 100:
        raise ConfigError(f"[server] checkpoint_work_fraction must be a number from 0 to 100, got {fraction!r}")
    rows = config.serial_decode_rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
        raise ConfigError(f"[server] serial_decode_rows must be a non-negative integer (0 disables), got {rows!r}")
    _check_parallel(config.parallel)
    return config


def _check_parallel(p: ParallelConfig) -> None:
    for name in ("tensor", "nnodes", "master_port"):
        value = getattr(p, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"[parallel] {name} must be a positive integer, got {value!r}")
    if not isinstance(p.node_rank, int) or isinstance(p.node_rank, bool) or not 0 <= p.node_rank < p.nnodes:
        raise ConfigError(f"[parallel] node_rank must be from 0 to nnodes - 1, got {p.node_rank!r}")
    if p.tensor % p.nnodes:
        raise ConfigError(f"[parallel] tensor ({p.tensor}) must be a multiple of nnodes ({p.nnodes})")
    if isinstance(p.timeout_s, bool) or not isinstance(p.timeout_s, (int, float)) or not 0 < p.timeout_s <= 3600:
        raise ConfigError(
            f"[parallel] timeout_s must be a number of seconds above 0 and at most 3600, got {p.timeout_s!r}"
        )
    for name in ("expert", "headless"):
        if not isinstance(getattr(p, name), bool):
            raise ConfigError(f"[parallel] {name} must be true or false")
    if not isinstance(p.master_addr, str) or not p.master_addr:
        raise ConfigError("[parallel] master_addr must be a nonempty string")


def load_config(
    path: Path | None = None,
    *,
    api_key_file: Path | None = None,
    host: str | None = None,
    port: int | None = None,
    draft_core: Path | None = None,
    parallel: dict[str, Any] | None = None,
    runtime: str | None = None,
) -> ServerConfig:
    """Build the server configuration: file, then flags (a key file overrides api_key; `parallel`:
    the [parallel] keys given as flags)."""
    values: dict[str, Any] = {}
    parallel_values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        unknown_tables = set(data) - {"server", "parallel"}
        if unknown_tables:
            raise ConfigError(
                f"config file {path}: unknown tables {sorted(unknown_tables)} (only [server] and [parallel] are read)"
            )
        values = dict(data.get("server", {}))
        parallel_values = dict(data.get("parallel", {}))
        known_parallel = {f.name for f in fields(ParallelConfig)}
        if set(parallel_values) - known_parallel:
            raise ConfigError(
                f"config file {path}: unknown [parallel] keys {sorted(set(parallel_values) - known_parallel)} "
                f"(known: {', '.join(sorted(known_parallel))})"
            )
        known = {f.name for f in fields(ServerConfig)} - {"parallel"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"config file {path}: unknown [server] keys {unknown} (known: {', '.join(sorted(known))})"
            )
        if "aliases" in values:
            if not isinstance(values["aliases"], list):
                raise ConfigError("[server] aliases must be a list of strings")
            values["aliases"] = tuple(values["aliases"])
    parallel_values.update(parallel or {})
    config = ServerConfig(**values, parallel=ParallelConfig(**parallel_values))
    if api_key_file is not None:
        try:
            key = api_key_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file {api_key_file}: {exc.strerror}") from None
        config = replace(config, api_key=key)
    if host is not None:
        config = replace(config, host=host)
    if port is not None:
        config = replace(config, port=port)
    if draft_core is not None:
        config = replace(config, draft_core=str(draft_core))
    if runtime is not None:
        config = replace(config, runtime=runtime)
    if config.api_key == "":
        config = replace(config, api_key=None)
    return _check(config)
