"""GET /metrics: the counter snapshot as JSON or Prometheus text 0.0.4, and the choice between them.

One read of the engine's metrics snapshot (helios.engine.EngineMetrics) plus the server's own
counters becomes a flat mapping keyed by the JSON field names of api.md's metrics table
(`values_of`); both expositions render that one mapping. Keys beyond the table (admission, uptime,
image-preparation caches) pass through to JSON unchanged and to Prometheus as flare_<key>: a
counter when the key ends in _total, else a gauge. The text is prometheus_client's, from a
collector over the mapping on a private registry.
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from helios.engine import EMPTY_HISTOGRAM, EngineMetrics, HistogramSnapshot

Number = int | float | bool
# api.md: "Prometheus text exposition format 0.0.4" (prometheus_client's CONTENT_TYPE_LATEST is 1.0.0 since 0.22).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (JSON field, Prometheus name or None, Prometheus type, help); order is exposition order.
FIELDS: tuple[tuple[str, str | None, str, str], ...] = (
    ("prefill_tokens", "flare_prefill_tokens_total", "counter", "Prompt tokens consumed by completed prefill"),
    ("generated_tokens", "flare_generated_tokens_total", "counter", "Committed generated tokens"),
    ("decode_weight_bytes", "flare_decode_weight_bytes", "gauge", "Weight bytes one decode step reads per request"),
    ("draft_steps", None, "counter", ""),
    ("verify_steps", "flare_speculative_rounds_total", "counter", "Completed speculative or verification graphs"),
    (
        "verification_drafts",
        "flare_verification_draft_tokens_total",
        "counter",
        "Draft positions allocated for progressing request rounds",
    ),
    (
        "verification_rounds",
        "flare_verification_request_rounds_total",
        "counter",
        "Progressing decode or verification request rounds",
    ),
    ("accepted_drafts", "flare_accepted_draft_tokens_total", "counter", "Accepted draft tokens, excluding the bonus"),
    ("draft_rounds", "flare_draft_request_rounds_total", "counter", "Request rounds that offered at least one draft"),
    ("active", "flare_active_requests", "gauge", "Model slots with a live request"),
    ("pending", "flare_pending_requests", "gauge", "Requests waiting in the model scheduler"),
    ("completed", "flare_requests_completed_total", "counter", "Requests whose generation completed"),
    (
        "reasoning_budget_cuts",
        "flare_reasoning_budget_cuts_total",
        "counter",
        "Requests whose reasoning was closed by the hard token budget",
    ),
    ("failed", "flare_requests_failed_total", "counter", "Requests failed by admission, execution or output"),
    (
        "replay_gpu_ns",
        "flare_replay_gpu_nanoseconds_total",
        "counter",
        "Nanoseconds of completed steps (program runs and sampling; CPU wall time, CUDA device-synchronised)",
    ),
    (
        "replay_readiness_wait_ns",
        "flare_replay_readiness_wait_nanoseconds_total",
        "counter",
        "Nanoseconds steps waited for host-store data (restore copies, disk prefetch)",
    ),
    (
        "replay_readiness_samples",
        "flare_replay_readiness_samples_total",
        "counter",
        "Completed steps that carried host-store restores",
    ),
    ("reused_tokens", "flare_cache_reused_tokens_total", "counter", "Tokens covered by GPU prefix-cache hits"),
    ("cached_pages", "flare_cached_kv_pages", "gauge", "KV pages holding an immutable cached prefix, in use or not"),
    ("free_pages", "flare_free_kv_pages", "gauge", "KV pages holding nothing and used by no request"),
    ("total_pages", "flare_total_kv_pages", "gauge", "Pages in the per-rank KV pool"),
    ("page_tokens", "flare_kv_page_tokens", "gauge", "Logical history tokens per KV page"),
    ("host_hits", "flare_host_cache_hits_total", "counter", "Host prefix-store lookups that fetched"),
    (
        "host_reused_tokens",
        "flare_host_cache_reused_tokens_total",
        "counter",
        "Tokens covered by host prefix-store chains",
    ),
    ("host_memory_records", "flare_host_cache_memory_records", "gauge", "Checkpoint records in host memory"),
    ("host_disk_records", "flare_host_cache_disk_records", "gauge", "Checkpoint records on disk"),
    ("host_bytes_out", "flare_host_cache_bytes_out_total", "counter", "Bytes copied from GPU to the host store"),
    ("host_bytes_in", "flare_host_cache_bytes_in_total", "counter", "Bytes copied from the host store to GPU"),
    ("learned_drafter", None, "gauge", ""),
)
_TABLE = {field for field, *_ in FIELDS}

# Server-side extras with a fixed name and help; always exposed (absent reads as zero).
EXTRAS: tuple[tuple[str, str, str], ...] = (
    (
        "preemptions_total",
        "counter",
        "Running sequences preempted (KV released, recomputed later) so older ones could grow",
    ),
    ("used_pages", "gauge", "KV pages held privately by live sequences (free + cached + used = total)"),
    ("http_admission_in_use", "gauge", "HTTP admission slots held"),
    ("http_admission_capacity", "gauge", "HTTP admission slots in total"),
    ("history_drafts_enabled", "gauge", "Whether shared decoded history augments learned proposals"),
    ("learned_draft_tokens_total", "counter", "Of the verified draft tokens, those the learned drafter proposed"),
    (
        "learned_accepted_draft_tokens_total",
        "counter",
        "Of the accepted draft tokens, those the learned drafter proposed",
    ),
    ("uptime_seconds", "gauge", "Seconds since server start"),
    ("state_slots", "gauge", "Recurrent-state slots of a hybrid core, live plus snapshot (0 for other cores)"),
    ("state_slot_bytes", "gauge", "Bytes of one recurrent-state slot over every recurrent layer"),
    ("state_slots_used", "gauge", "Live recurrent-state slots held by running sequences"),
    ("state_snapshots", "gauge", "Recurrent-state prefix snapshots held for reuse"),
    (
        "state_rewinds_total",
        "counter",
        "Speculative rounds of a hybrid core whose rejected drafts rewound its recurrent state (committed tokens recomputed)",
    ),
    (
        "checkpoint_anchor_reservations",
        "gauge",
        "Unused anchor guards: snapshot slots kept for conversation anchors that no anchor holds or is armed to fill",
    ),
    (
        "checkpoint_extra_work_nanoseconds_total",
        "counter",
        "Predicted extra prefill and copy work charged for hinted checkpoints (not a GPU timing)",
    ),
    ("host_cache_parked_records", "gauge", "Complete DRAM copies awaiting disk writes"),
    (
        "host_cache_store_skipped_total",
        "counter",
        "Copy-out offers of records the host store already held or was copying (duplicates and retries)",
    ),
    (
        "host_cache_copyout_headroom_deferrals_total",
        "counter",
        "Copy-out offers deferred by the pool headroom check before pinning pages (retried at a later step)",
    ),
    (
        "host_cache_slots_in_use",
        "gauge",
        "Local checkpoint pool slots in use: KV pages and recurrent-state slots not free (live, cached, pinned)",
    ),
    (
        "host_cache_slots_total",
        "gauge",
        "Local checkpoint pool slots: KV pages plus recurrent-state slots, the copy-out intake included",
    ),
    ("host_cache_intake_slots", "gauge", "Pool slots the copy-out intake may hold pinned for the host store at once"),
    ("host_cache_anchor_records", "gauge", "Host-memory records of conversation anchors' chains (evicted last)"),
    (
        "host_cache_copyout_pinned_records",
        "gauge",
        "KV pages and state snapshots pinned for the copy-out thread and not yet released",
    ),
    (
        "host_cache_copyout_waits_total",
        "counter",
        "Times the engine thread waited for the copy-out thread because the pool needed pinned pages",
    ),
    ("host_cache_copyout_wait_nanoseconds_total", "counter", "Engine-thread nanoseconds spent in those waits"),
    (
        "host_cache_copyout_worker_nanoseconds_total",
        "counter",
        "Copy-out thread nanoseconds spent copying pinned pages and snapshots into host records",
    ),
)
_EXTRA_NAMES = {key for key, *_ in EXTRAS}
# JSON-only keys: strings with no Prometheus sample (api.md names learned_drafter's kind nowhere in the text).
JSON_ONLY = frozenset({"learned_drafter_name"})

# Labelled counters: JSON holds {"label value[/label value]": count} (absent entries read as zero);
# Prometheus one line per entry, every label value api.md names included (zero until counted).
_TIERS, _DROP_REASONS = ("dram", "nvme"), ("end_of_chain", "oversize", "io_error")
LABELLED: tuple[tuple[str, str, str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "host_cache_held",
        "flare_host_cache_held_total",
        "counter",
        "Records the host prefix store took in, by tier",
        ("tier",),
        _TIERS,
    ),
    (
        "host_cache_dropped",
        "flare_host_cache_dropped_total",
        "counter",
        "Records the host prefix store dropped, by tier and reason",
        ("tier", "reason"),
        tuple(f"{tier}/{reason}" for tier in _TIERS for reason in _DROP_REASONS),
    ),
    (
        "checkpoint_captures",
        "flare_checkpoint_captures_total",
        "counter",
        "Recurrent-state checkpoints captured, by role (anchor: the end of a system/tools block; message: a "
        "message or cache_control block end, or a prompt's last page boundary; endpoint: a finished sequence's "
        "last full page)",
        ("role",),
        ("anchor", "message", "endpoint"),
    ),
    (
        "checkpoint_skips",
        "flare_checkpoint_skips_total",
        "counter",
        "Checkpoint captures not made, by reason",
        ("reason",),
        ("unknown_cost", "work_budget", "storage"),
    ),
    # api.md: "graph launches by kind", unnamed there; docs/serving.md names it
    (
        "graph_launches",
        "flare_graph_launches_total",
        "counter",
        "Step program launches, by kind (graph: a captured CUDA graph replayed; eager: run op by op)",
        ("kind",),
        ("graph", "eager"),
    ),
)
_LABELLED_NAMES = {key for key, *_ in LABELLED}

HISTOGRAMS: tuple[tuple[str, str], ...] = (
    ("flare_host_cache_missing_tokens", "Tokens a host prefix-store lookup could not cover"),
    ("flare_host_cache_estimated_transfer_ns", "Estimated host-to-GPU transfer time of a lookup"),
    ("flare_host_cache_estimated_prefill_ns", "Estimated prefill time a lookup would replace"),
)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """What the server counts itself, beside the engine's snapshot."""

    http_admission_in_use: int  # admission slots held
    http_admission_capacity: int  # admission slots in total
    uptime_seconds: int  # whole seconds since the server started
    image_counters: Mapping[str, int]  # the frontend's share of the IMAGE_COUNTERS (decoding, rejections)


def values_of(engine: EngineMetrics, server: ServerCounters) -> dict[str, Any]:
    """The flat mapping both expositions render: JSON field name -> number, or for labelled
    counters {"label value[/label value]": count}; learned_drafter_name is JSON only."""
    e = engine
    values: dict[str, Any] = {
        "prefill_tokens": e.prefill_tokens,
        "generated_tokens": e.generated_tokens,
        "decode_weight_bytes": e.decode_weight_bytes,
        "verification_rounds": e.verification_rounds,
        "active": e.active,
        "pending": e.pending,
        "completed": e.completed,
        "failed": e.failed,
        "reused_tokens": e.reused_tokens,
        "cached_pages": e.cached_pages,
        "free_pages": e.free_pages,
        "total_pages": e.total_pages,
        "page_tokens": e.page_tokens,
        "reasoning_budget_cuts": e.reasoning_budget_cuts,
        "verify_steps": e.verify_steps,
        "verification_drafts": e.verification_drafts,
        "accepted_drafts": e.accepted_drafts,
        "draft_rounds": e.draft_rounds,
        "draft_steps": e.draft_steps,
        "state_slots": e.state_slots,
        "state_slot_bytes": e.state_slot_bytes,
        "state_slots_used": e.state_slots_used,
        "state_snapshots": e.state_snapshots,
        "checkpoint_anchor_reservations": e.checkpoint_anchor_reservations,
    }
    values.update(e.images)  # image preparation and feature counters (engine), plus the frontend's
    for name, count in server.image_counters.items():
        values[name] = values.get(name, 0) + count
    values.update(
        checkpoint_captures=dict(e.checkpoint_captures),
        checkpoint_skips=dict(e.checkpoint_skips),
        checkpoint_extra_work_nanoseconds_total=e.checkpoint_extra_work_ns,
        host_cache_slots_in_use=e.checkpoint_slots_in_use,
        host_cache_slots_total=e.checkpoint_slots_total,
        host_cache_intake_slots=e.checkpoint_intake_slots,
    )
    if (host := e.host) is not None:
        values.update(
            host_hits=host.hits,
            host_reused_tokens=host.reused_tokens,
            host_memory_records=host.memory_records,
            host_disk_records=host.disk_records,
            host_bytes_out=host.bytes_out,
            host_bytes_in=host.bytes_in,
            host_cache_parked_records=host.parked_records,
            host_cache_store_skipped_total=host.skipped,
            host_cache_held=dict(host.held),
            host_cache_anchor_records=host.anchor_records,
            host_cache_copyout_pinned_records=host.copyout_pinned_records,
            host_cache_copyout_headroom_deferrals_total=host.copyout_deferrals,
            host_cache_copyout_waits_total=host.copyout_waits,
            host_cache_copyout_wait_nanoseconds_total=host.copyout_wait_ns,
            host_cache_copyout_worker_nanoseconds_total=host.copyout_worker_ns,
            host_cache_dropped=dict(host.dropped),
        )
    values.update(
        preemptions_total=e.preemptions,
        state_rewinds_total=e.state_rewinds,
        replay_gpu_ns=e.replay_ns,
        replay_readiness_wait_ns=e.readiness_wait_ns,
        replay_readiness_samples=e.readiness_samples,
        used_pages=e.total_pages - e.free_pages - e.cached_pages,
        # api.md: learned_drafter is a boolean; which drafter it is goes beside it (JSON only):
        # "mtp" for the core's MTP programs, a draft core's model id, or null.
        learned_drafter=e.learned_drafter is not None,
        learned_drafter_name=e.learned_drafter,
        learned_draft_tokens_total=e.learned_offered,
        learned_accepted_draft_tokens_total=e.learned_accepted,
        history_drafts_enabled=int(e.history_drafts_enabled),
        http_admission_in_use=server.http_admission_in_use,
        http_admission_capacity=server.http_admission_capacity,
        uptime_seconds=server.uptime_seconds,
        graph_launches=dict(e.graph_launches),  # by kind: graph (CUDA replay), eager
    )
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
    return {
        "flare_host_cache_missing_tokens": host.missing_tokens,
        "flare_host_cache_estimated_transfer_ns": host.estimated_transfer_ns,
        "flare_host_cache_estimated_prefill_ns": host.estimated_prefill_ns,
    }


def json_snapshot(
    values: Mapping[str, Any],
    first_response: Mapping[str, Any],
    histograms: Mapping[str, HistogramSnapshot] | None = None,
) -> dict[str, Any]:
    """Every table field (absent = 0, integers except learned_drafter), extras, first_response, and
    each histogram under its Prometheus name without flare_: {"buckets": {le: cumulative count},
    "sum", "count"} (empty without a host prefix store)."""
    out: dict[str, Any] = {field: int(values.get(field, 0)) for field, *_ in FIELDS}
    out["learned_drafter"] = bool(values.get("learned_drafter", False))
    out["learned_drafter_name"] = values.get("learned_drafter_name")
    out.update((key, value) for key, value in values.items() if key not in _TABLE)
    for key in _LABELLED_NAMES:
        out.setdefault(key, {})
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
    """The families of one /metrics read, in exposition order: the table, the extras, the labelled
    counters (every label value api.md names, zero until counted), pass-through keys, the
    first-response window, and the host-store histograms (empty without a host prefix store)."""

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
        for field, name, kind, help_text in FIELDS:
            if name is not None:
                yield _family(name, kind, help_text, int(values.get(field, 0)))
        for key, kind, help_text in EXTRAS:
            yield _family(f"flare_{key}", kind, help_text, values.get(key, 0))
        for key, name, kind, help_text, labels, known in LABELLED:
            family = _FAMILIES[kind](name, help_text, labels=labels)
            counts = dict.fromkeys(known, 0) | dict(values.get(key) or {})
            for label_values, count in sorted(counts.items()):
                family.add_metric(label_values.split("/"), count)
            yield family
        for key, value in values.items():
            if key in _TABLE or key in _EXTRA_NAMES or key in _LABELLED_NAMES or key in JSON_ONLY:
                continue
            if not _NAME.fullmatch(key):
                raise ValueError(f"metric key {key!r} is not a valid Prometheus name")
            yield _family(
                f"flare_{key}", "counter" if key.endswith("_total") else "gauge", key.replace("_", " "), value
            )
        yield _family(
            "flare_first_response_median_seconds",
            "gauge",
            "Median seconds from HTTP admission to first offered text over the window",
            self.first_response.get("median_seconds"),
        )
        yield _family(
            "flare_first_response_samples",
            "gauge",
            "First-response samples in the window",
            self.first_response.get("samples", 0),
        )
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
