"""GET /metrics: the counter snapshot as JSON or Prometheus text 0.0.4, and the choice between them.

Input is a flat mapping of engine and server counters keyed by the JSON field names of
api.md's metrics table. Keys beyond the table (admission, uptime, image-preparation caches)
pass through to JSON unchanged and to Prometheus as flare_<key>: a counter when the key
ends in _total, else a gauge.
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

Number = int | float | bool

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
    ("replay_gpu_ns", "flare_replay_gpu_nanoseconds_total", "counter", "GPU nanoseconds of completed graphs"),
    (
        "replay_readiness_wait_ns",
        "flare_replay_readiness_wait_nanoseconds_total",
        "counter",
        "Exposed embedding readiness delay in nanoseconds",
    ),
    (
        "replay_readiness_samples",
        "flare_replay_readiness_samples_total",
        "counter",
        "Completed graphs with readiness timing",
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


def json_snapshot(
    values: Mapping[str, Number], first_response: Mapping[str, Any], histograms: Mapping[str, Any] | None = None
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
        histogram = (histograms or {}).get(name)
        buckets = histogram.cumulative() if histogram is not None else [("+Inf", 0)]
        out[name.removeprefix("flare_")] = {
            "buckets": dict(buckets),
            "count": buckets[-1][1],
            "sum": histogram.sum if histogram is not None else 0,
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
    values: Mapping[str, Number], first_response: Mapping[str, Any], histograms: Mapping[str, Any] | None = None
) -> str:
    """Text exposition format 0.0.4, ending with a newline."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: Number | None) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"])

    for field, name, kind, help_text in FIELDS:
        if name is not None:
            metric(name, kind, help_text, int(values.get(field, 0)))
    for key, kind, help_text in EXTRAS:
        metric(f"flare_{key}", kind, help_text, values.get(key, 0))
    for key, name, kind, help_text, labels, known in LABELLED:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        counts = dict.fromkeys(known, 0) | dict(values.get(key) or {})  # type: ignore[call-overload]
        for label_values, count in sorted(counts.items()):
            pairs = ",".join(f'{label}="{value}"' for label, value in zip(labels, label_values.split("/"), strict=True))
            lines.append(f"{name}{{{pairs}}} {_number(count)}")
    for key, value in values.items():
        if key in _TABLE or key in _EXTRA_NAMES or key in _LABELLED_NAMES or key in JSON_ONLY:
            continue
        if not _NAME.fullmatch(key):
            raise ValueError(f"metric key {key!r} is not a valid Prometheus name")
        kind = "counter" if key.endswith("_total") else "gauge"
        metric(f"flare_{key}", kind, key.replace("_", " "), value)
    metric(
        "flare_first_response_median_seconds",
        "gauge",
        "Median seconds from HTTP admission to first offered text over the window",
        first_response.get("median_seconds"),
    )
    metric(
        "flare_first_response_samples",
        "gauge",
        "First-response samples in the window",
        first_response.get("samples", 0),
    )
    for name, help_text in HISTOGRAMS:  # empty without a host prefix store
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        histogram = (histograms or {}).get(name)
        buckets = histogram.cumulative() if histogram is not None else [("+Inf", 0)]
        lines += [f'{name}_bucket{{le="{le}"}} {count}' for le, count in buckets]
        lines += [
            f"{name}_sum {_number(histogram.sum if histogram is not None else 0)}",
            f"{name}_count {buckets[-1][1]}",
        ]
    return "\n".join(lines) + "\n"


def _number(value: Number | None) -> str:
    if value is None:
        return "NaN"
    if isinstance(value, bool) or isinstance(value, int):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


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
