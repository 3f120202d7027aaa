"""GET /metrics: the counter snapshot as JSON or Prometheus text 0.0.4, and the choice between them.

One read of the engine's metrics snapshot (helios.engine.EngineMetrics) plus the server's own
counters becomes a flat mapping keyed by the JSON field names of api.md's metrics table
(`values_of`); both expositions render that one mapping. One table of `Spec`s (SPECS: api.md's
fields, the extras, the labelled counters) names every metric: its JSON key, Prometheus name,
type, help and where values_of reads it. Keys beyond the specs
(image-preparation caches, speculative counters by depth, batch and width) pass through to JSON
unchanged and to Prometheus as flare_<key>: a counter when the key ends in _total, else a gauge.
The text is prometheus_client's, from a collector over the mapping on a private registry.
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from helios.engine import EMPTY_HISTOGRAM, EngineMetrics, HistogramSnapshot

Number = int | float | bool
# api.md: "Prometheus text exposition format 0.0.4" (prometheus_client's CONTENT_TYPE_LATEST is 1.0.0 since 0.22).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Spec:
    """One exported metric: its JSON key, help, where values_of reads it, and its Prometheus form."""

    key: str  # the JSON key
    help: str
    # What values_of reads: "" the EngineMetrics attribute named like the key, else an EngineMetrics
    # attribute, "host.<attribute>" (absent without a host prefix store) or "server.<attribute>"
    # (ServerCounters); None: values_of computes it.
    source: str | None = ""
    name: str | None = ""  # the Prometheus name; "": flare_<key>; None: JSON only (api.md: "none")
    kind: str = ""  # "counter" or "gauge"; "": a counter when the Prometheus name ends in _total
    labels: tuple[str, ...] = ()  # labelled counters' label names; JSON holds {"value[/value]": count}
    known: tuple[str, ...] = ()  # every label value api.md names: exported, zero until counted

    @property
    def metric(self) -> str:
        return self.name or f"flare_{self.key}"

    @property
    def type(self) -> str:
        return self.kind or ("counter" if self.metric.endswith("_total") else "gauge")


def _specs(table: str) -> tuple[Spec, ...]:
    """The Specs of a `|`-separated table whose first row names Spec fields, one Spec a row. In
    the name and source columns "none" reads as None (see Spec) and a blank cell as ""; labels
    and known hold space-separated values."""
    header, *rows = ([cell.strip() for cell in line.split("|")] for line in table.strip().splitlines())
    return tuple(
        Spec(**{column: _cell(column, text) for column, text in zip(header, row, strict=True)}) for row in rows
    )


def _cell(column: str, text: str) -> str | tuple[str, ...] | None:
    if column in ("labels", "known"):
        return tuple(text.split())
    return None if text == "none" and column in ("name", "source") else text


# api.md's metrics table, in its order; every field is in JSON (absent reads as zero).
FIELDS = _specs(
    """
    key                      | name                                          | source              | help
    prefill_tokens           | flare_prefill_tokens_total                    |                     | Prompt tokens consumed by completed prefill
    generated_tokens         | flare_generated_tokens_total                  |                     | Committed generated tokens
    decode_weight_bytes      | flare_decode_weight_bytes                     |                     | Weight bytes one decode step reads per request
    draft_steps              | none                                          |                     |
    verify_steps             | flare_speculative_rounds_total                |                     | Completed speculative or verification graphs
    verification_drafts      | flare_verification_draft_tokens_total         |                     | Draft positions allocated for progressing request rounds
    verification_rounds      | flare_verification_request_rounds_total       |                     | Progressing decode or verification request rounds
    accepted_drafts          | flare_accepted_draft_tokens_total             |                     | Accepted draft tokens, excluding the bonus
    draft_rounds             | flare_draft_request_rounds_total              |                     | Request rounds that offered at least one draft
    active                   | flare_active_requests                         |                     | Model slots with a live request
    pending                  | flare_pending_requests                        |                     | Requests waiting in the model scheduler
    completed                | flare_requests_completed_total                | server.completed    | Requests whose generation completed
    reasoning_budget_cuts    | flare_reasoning_budget_cuts_total             |                     | Requests whose reasoning was closed by the hard token budget
    failed                   | flare_requests_failed_total                   | server.failed       | Requests failed by admission, execution or output
    replay_gpu_ns            | flare_replay_gpu_nanoseconds_total            | replay_ns           | Nanoseconds of completed steps (CPU: wall time of program runs and sampling; CUDA: events around the programs, rank 0)
    replay_readiness_wait_ns | flare_replay_readiness_wait_nanoseconds_total | readiness_wait_ns   | Nanoseconds steps waited for host data: host-store restores and disk prefetch, and embedding rows from RAM or disk
    replay_readiness_samples | flare_replay_readiness_samples_total          | readiness_samples   | Completed steps that carried host-store restores or read embedding rows from the host
    reused_tokens            | flare_cache_reused_tokens_total               |                     | Tokens covered by GPU prefix-cache hits
    cached_pages             | flare_cached_kv_pages                         |                     | KV pages holding an immutable cached prefix, in use or not
    free_pages               | flare_free_kv_pages                           |                     | KV pages holding nothing and used by no request
    total_pages              | flare_total_kv_pages                          |                     | Pages in the per-rank KV pool
    page_tokens              | flare_kv_page_tokens                          |                     | Logical history tokens per KV page
    host_hits                | flare_host_cache_hits_total                   | host.hits           | Host prefix-store lookups that fetched
    host_reused_tokens       | flare_host_cache_reused_tokens_total          | host.reused_tokens  | Tokens covered by host prefix-store chains
    host_memory_records      | flare_host_cache_memory_records               | host.memory_records | Checkpoint records in host memory
    host_disk_records        | flare_host_cache_disk_records                 | host.disk_records   | Checkpoint records on disk
    host_bytes_out           | flare_host_cache_bytes_out_total              | host.bytes_out      | Bytes copied from GPU to the host store
    host_bytes_in            | flare_host_cache_bytes_in_total               | host.bytes_in       | Bytes copied from the host store to GPU
    learned_drafter          | none                                          | none                |
    """
)
# Beyond the table, as flare_<key>: in JSON when read (host-store ones need a host prefix store), in
# Prometheus always (absent reads as zero).
EXTRAS = _specs(
    """
    key                                         | source                         | kind  | help
    preemptions_total                           | preemptions                    |       | Running sequences preempted (KV released, recomputed later) so older ones could grow
    used_pages                                  | none                           |       | KV pages held privately by live sequences (free + cached + used = total)
    parallel_ranks                              |                                | gauge | Tensor-parallel ranks the engine runs on; each rank's KV pool holds total_pages pages
    http_admission_in_use                       | server.http_admission_in_use   |       | HTTP admission slots held
    http_admission_capacity                     | server.http_admission_capacity |       | HTTP admission slots in total
    history_drafts_enabled                      | none                           |       | Whether shared decoded history augments learned proposals
    learned_draft_tokens_total                  | learned_offered                |       | Of the verified draft tokens, those the learned drafter proposed
    learned_accepted_draft_tokens_total         | learned_accepted               |       | Of the accepted draft tokens, those the learned drafter proposed
    uptime_seconds                              | server.uptime_seconds          |       | Seconds since server start
    state_slots                                 |                                |       | Recurrent-state slots of a hybrid core, live plus snapshot (0 for other cores)
    state_slot_bytes                            |                                |       | Bytes of one recurrent-state slot over every recurrent layer
    state_slots_used                            |                                |       | Live recurrent-state slots held by running sequences
    state_snapshots                             |                                |       | Recurrent-state prefix snapshots held for reuse
    state_rewinds_total                         | state_rewinds                  |       | Speculative rounds of a hybrid core whose rejected drafts rewound its recurrent state (committed tokens recomputed)
    checkpoint_anchor_reservations              |                                |       | Unused anchor guards: snapshot slots kept for conversation anchors that no anchor holds or is armed to fill
    checkpoint_extra_work_nanoseconds_total     | checkpoint_extra_work_ns       |       | Predicted extra prefill and copy work charged for hinted checkpoints (not a GPU timing)
    host_cache_parked_records                   | host.parked_records            |       | Complete DRAM copies awaiting disk writes
    host_cache_store_skipped_total              | host.skipped                   |       | Copy-out offers of records the host store already held or was copying (duplicates and retries)
    host_cache_copyout_headroom_deferrals_total | host.copyout_deferrals         |       | Copy-out offers deferred by the pool headroom check before pinning pages (retried at a later step)
    host_cache_slots_in_use                     | checkpoint_slots_in_use        |       | Local checkpoint pool slots in use: KV pages and recurrent-state slots not free (live, cached, pinned)
    host_cache_slots_total                      | checkpoint_slots_total         | gauge | Local checkpoint pool slots: KV pages plus recurrent-state slots, the copy-out intake included
    host_cache_intake_slots                     | checkpoint_intake_slots        |       | Pool slots the copy-out intake may hold pinned for the host store at once
    host_cache_anchor_records                   | host.anchor_records            |       | Host-memory records of conversation anchors' chains (evicted last)
    host_cache_copyout_pinned_records           | host.copyout_pinned_records    |       | KV pages and state snapshots pinned for the copy-out thread and not yet released
    host_cache_copyout_waits_total              | host.copyout_waits             |       | Times the engine thread waited for the copy-out thread because the pool needed pinned pages
    host_cache_copyout_wait_nanoseconds_total   | host.copyout_wait_ns           |       | Engine-thread nanoseconds spent in those waits
    host_cache_copyout_worker_nanoseconds_total | host.copyout_worker_ns         |       | Copy-out thread nanoseconds spent copying pinned pages and snapshots into host records
    embedding_row_cache_lookups_total           | embedding_row_lookups          |       | Distinct host embedding table rows step programs asked the device row cache for (0 without host tables)
    embedding_row_cache_hits_total              | embedding_row_hits             |       | Embedding row-cache lookups found on the device
    embedding_row_cache_misses_total            | embedding_row_misses           |       | Embedding row-cache lookups read from the host table (RAM or disk) and copied in
    embedding_row_cache_evictions_total         | embedding_row_evictions        |       | Resident embedding rows dropped, least recently used first, for missed ones
    embedding_row_cache_host_bytes_total        | embedding_row_host_bytes       |       | Bytes of embedding rows read from the host table
    embedding_row_cache_rows                    | embedding_rows_resident        | gauge | Embedding rows resident in the device row cache
    embedding_row_cache_capacity_rows           | embedding_row_capacity         | gauge | Embedding rows the device row cache holds at most
    """
) + (Spec("learned_drafter_name", "", source=None, name=None),)  # JSON only: "mtp", a draft core's model id, or null
# Labelled counters: one Prometheus line per label value (every value api.md names, zero until counted).
# api.md: "graph launches by kind", unnamed there; docs/serving.md names it.
LABELLED = _specs(
    """
    key                 | source       | name                            | labels      | known                                                                                       | help
    host_cache_held     | host.held    | flare_host_cache_held_total     | tier        | dram nvme                                                                                   | Records the host prefix store took in, by tier
    host_cache_dropped  | host.dropped | flare_host_cache_dropped_total  | tier reason | dram/end_of_chain dram/oversize dram/io_error nvme/end_of_chain nvme/oversize nvme/io_error | Records the host prefix store dropped, by tier and reason
    checkpoint_captures |              | flare_checkpoint_captures_total | role        | anchor message endpoint                                                                     | Recurrent-state checkpoints captured, by role (anchor: the end of a system/tools block; message: a message or cache_control block end, or a prompt's last page boundary; endpoint: a finished sequence's last full page)
    checkpoint_skips    |              | flare_checkpoint_skips_total    | reason      | unknown_cost work_budget storage                                                            | Checkpoint captures not made, by reason
    graph_launches      |              | flare_graph_launches_total      | kind        | graph eager                                                                                 | Step program launches, by kind (graph: a captured CUDA graph replayed; eager: run op by op)
    """
)
SPECS = FIELDS + EXTRAS + LABELLED  # Prometheus exposition order
HISTOGRAMS: tuple[tuple[str, str], ...] = (  # the host store's (HostStoreMetrics.<name without flare_host_cache_>)
    ("flare_host_cache_missing_tokens", "Tokens a host prefix-store lookup could not cover"),
    ("flare_host_cache_estimated_transfer_ns", "Estimated host-to-GPU transfer time of a lookup"),
    ("flare_host_cache_estimated_prefill_ns", "Estimated prefill time a lookup would replace"),
)
# (Prometheus name, first_response key, its value when absent, help)
FIRST_RESPONSE = (
    (
        "flare_first_response_median_seconds",
        "median_seconds",
        None,
        "Median seconds from HTTP admission to first offered text over the window",
    ),
    ("flare_first_response_samples", "samples", 0, "First-response samples in the window"),
)
_TABLE = frozenset(spec.key for spec in FIELDS)
_KEYS = frozenset(spec.key for spec in SPECS)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """What the server counts itself, beside the engine's snapshot."""

    http_admission_in_use: int  # admission slots held
    http_admission_capacity: int  # admission slots in total
    uptime_seconds: int  # whole seconds since the server started
    image_counters: Mapping[str, int] = field(default_factory=dict)  # the frontend's share of IMAGE_COUNTERS
    completed: int = 0  # requests by the outcome their client saw (helios/server/outcomes.py)
    failed: int = 0


def values_of(engine: EngineMetrics, server: ServerCounters) -> dict[str, Any]:
    """The flat mapping both expositions render: JSON key -> number, or for labelled counters
    {"label value[/label value]": count}; learned_drafter_name is JSON only."""
    owners = {"": engine, "host": engine.host, "server": server}
    values: dict[str, Any] = {}
    for spec in SPECS:
        if spec.source is None:
            continue
        owner, _, attribute = (spec.source or spec.key).rpartition(".")
        if owners[owner] is not None:  # host-store metrics are absent without one
            value = getattr(owners[owner], attribute)
            values[spec.key] = dict(value) if spec.labels else value
    e = engine
    values.update(
        used_pages=e.total_pages - e.free_pages - e.cached_pages,
        learned_drafter=e.learned_drafter is not None,  # api.md: a boolean; its name goes beside it
        learned_drafter_name=e.learned_drafter,
        history_drafts_enabled=int(e.history_drafts_enabled),
    )
    values.update(e.images)  # image preparation and feature counters (engine), plus the frontend's
    for name, count in server.image_counters.items():
        values[name] = values.get(name, 0) + count
    # Speculative counters by depth (drafts a request round offered), batch (decode rows in a
    # verification step) and width (1 + the most drafts any row group of the step carried).
    for label, table in (("depth", e.rounds_by_depth), ("batch", e.steps_by_batch), ("width", e.steps_by_width)):
        for key, count in table:
            values[f"speculative_{'rounds' if label == 'depth' else 'steps'}_{label}_{key}_total"] = count
    return values


def histograms_of(engine: EngineMetrics) -> dict[str, HistogramSnapshot]:
    """Prometheus histogram name -> its state (none without a host prefix store)."""
    host = engine.host
    if host is None:
        return {}
    return {name: getattr(host, name.removeprefix("flare_host_cache_")) for name, _ in HISTOGRAMS}


def json_snapshot(
    values: Mapping[str, Any],
    first_response: Mapping[str, Any],
    histograms: Mapping[str, HistogramSnapshot] | None = None,
) -> dict[str, Any]:
    """Every table field (absent = 0, integers except learned_drafter), extras, first_response, and
    each histogram under its Prometheus name without flare_: {"buckets": {le: cumulative count},
    "sum", "count"} (empty without a host prefix store)."""
    out: dict[str, Any] = {spec.key: int(values.get(spec.key, 0)) for spec in FIELDS}
    out["learned_drafter"] = bool(values.get("learned_drafter", False))
    out["learned_drafter_name"] = values.get("learned_drafter_name")
    out.update((key, value) for key, value in values.items() if key not in _TABLE)
    for spec in LABELLED:
        out.setdefault(spec.key, {})
    for name, _ in HISTOGRAMS:
        histogram = (histograms or {}).get(name, EMPTY_HISTOGRAM)
        out[name.removeprefix("flare_")] = {
            "buckets": dict(histogram.buckets),
            "count": histogram.count,
            "sum": histogram.sum,
        }
    out["first_response"] = {
        "median_seconds": first_response.get("median_seconds"),
        "samples": int(first_response.get("samples", 0)),
        "window_seconds": first_response.get("window_seconds", 60),
        "capacity": int(first_response.get("capacity", 0)),
        "truncated": bool(first_response.get("truncated", False)),
    }
    return out


def prometheus_text(
    values: Mapping[str, Any],
    first_response: Mapping[str, Any],
    histograms: Mapping[str, HistogramSnapshot] | None = None,
) -> str:
    """Text exposition format 0.0.4 (prometheus_client's), ending with a newline."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(values, first_response, histograms or {}))
    return generate_latest(registry).decode()


class MetricsCollector(Collector):
    """The families of one /metrics read, in exposition order: the specs (table, extras, labelled
    counters), pass-through keys, the first-response window, and the host-store histograms (empty
    without a host prefix store)."""

    def __init__(
        self,
        values: Mapping[str, Any],
        first_response: Mapping[str, Any],
        histograms: Mapping[str, HistogramSnapshot],
    ) -> None:
        self.values, self.first_response, self.histograms = values, first_response, histograms

    def describe(self) -> list[Metric]:
        return []  # names are fixed by the tables; the private registry has nothing to clash with

    def collect(self) -> Iterator[Metric]:
        values = self.values
        for spec in SPECS:
            if spec.name is None:
                continue
            if not spec.labels:
                value = values.get(spec.key, 0)
                yield _family(spec.metric, spec.type, spec.help, int(value) if spec.key in _TABLE else value)
                continue
            family = _FAMILIES[spec.type](spec.metric, spec.help, labels=spec.labels)
            counts = dict.fromkeys(spec.known, 0) | dict(values.get(spec.key) or {})
            for label_values, count in sorted(counts.items()):
                family.add_metric(label_values.split("/"), count)
            yield family
        for key, value in values.items():
            if key in _KEYS:
                continue
            if not _NAME.fullmatch(key):
                raise ValueError(f"metric key {key!r} is not a valid Prometheus name")
            spec = Spec(key, key.replace("_", " "))
            yield _family(spec.metric, spec.type, spec.help, value)
        for name, key, absent, help_text in FIRST_RESPONSE:
            yield _family(name, "gauge", help_text, self.first_response.get(key, absent))
        for name, help_text in HISTOGRAMS:
            histogram = self.histograms.get(name, EMPTY_HISTOGRAM)
            yield HistogramMetricFamily(name, help_text, buckets=list(histogram.buckets), sum_value=histogram.sum)


_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def _family(name: str, kind: str, help_text: str, value: Number | None) -> Metric:
    """One unlabelled counter or gauge; None (no value yet) is NaN."""
    return _FAMILIES[kind](name, help_text, value=math.nan if value is None else float(value))


class FirstResponseWindow:
    """Time from HTTP admission to the first offered text, kept for the last window_seconds.

    At most `capacity` samples are held; when more arrive the oldest are dropped and the
    summary reports truncated while a dropped sample would still be inside the window.
    """

    def __init__(self, window_seconds: float = 60, capacity: int = 4096) -> None:
        self.window_seconds, self.capacity = window_seconds, capacity
        self._samples: deque[tuple[float, float]] = deque()  # (monotonic time, seconds)
        self._last_dropped: float | None = None  # time of the newest sample evicted for capacity
        self._lock = threading.Lock()

    def record(self, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            if len(self._samples) >= self.capacity:
                self._last_dropped = self._samples.popleft()[0]
            self._samples.append((now, seconds))

    def summary(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            values = [seconds for _, seconds in self._samples]
            dropped = self._last_dropped is not None and self._last_dropped > now - self.window_seconds
        return {
            "median_seconds": statistics.median(values) if values else None,
            "samples": len(values),
            "window_seconds": self.window_seconds,
            "capacity": self.capacity,
            "truncated": dropped,
        }

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.window_seconds:
            self._samples.popleft()


def choose_format(format_query: str | None, accept: str | None) -> str:
    """ "json" or "prometheus" per api.md; ValueError for a format value other than those two."""
    if format_query is not None:
        if format_query.strip().lower() in ("json", "prometheus"):
            return format_query.strip().lower()
        raise ValueError(f"format must be json or prometheus, got {format_query!r}")
    json_pref, text_pref = _preference(accept or "", "application", "json"), _preference(accept or "", "text", "plain")
    if json_pref[0] > text_pref[0] or (json_pref[0] == text_pref[0] > 0 and json_pref[1] < text_pref[1]):
        return "json"
    return "prometheus"


def _preference(accept: str, main: str, sub: str) -> tuple[float, int]:
    """(quality, position) of the most specific media range matching main/sub (RFC 9110 §12.5.1).

    application/openmetrics-text counts as text/plain: scrapers asking for it want text.
    """
    best: tuple[int, float, int] = (-1, 0.0, 0)  # (specificity, quality, -position)
    for position, media_range in enumerate(accept.split(",")):
        kind, *params = (part.strip() for part in media_range.split(";"))
        kind = kind.lower()
        if kind == "application/openmetrics-text":
            kind = "text/plain"
        specificity = {f"{main}/{sub}": 2, f"{main}/*": 1, "*/*": 0}.get(kind)
        if specificity is None:
            continue
        quality = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    quality = 0.0  # a malformed q is not a preference
        best = max(best, (specificity, quality, -position))
    return (best[1], -best[2]) if best[0] >= 0 else (0.0, 1 << 30)
