"""/metrics rendering: Prometheus text parses with the reference parser, JSON has every field,
Accept negotiation follows api.md, and the first-response window summarises the last minute."""

from __future__ import annotations

import pytest
from metrics_checks import engine_metrics, expositions_disagree, host_metrics
from prometheus_client.parser import text_string_to_metric_families

from helios.engine import IMAGE_COUNTERS, HistogramSnapshot
from helios.server.metrics import (
    FIELDS,
    FirstResponseWindow,
    ServerCounters,
    choose_format,
    histograms_of,
    json_snapshot,
    prometheus_text,
    values_of,
)

VALUES = {
    "prefill_tokens": 120,
    "generated_tokens": 42,
    "completed": 3,
    "failed": 1,
    "reused_tokens": 64,
    "active": 2,
    "pending": 5,
    "free_pages": 900,
    "total_pages": 1024,
    "cached_pages": 7,
    "page_tokens": 16,
    "decode_weight_bytes": 270_000_000,
    "verify_steps": 9,
    "learned_drafter": True,
    "http_admission_in_use": 4,
    "http_admission_capacity": 512,
    "uptime_seconds": 12.5,
    "input_decoded_images_total": 6,
}
EMPTY_WINDOW = FirstResponseWindow().summary(now=0.0)
SERVER = ServerCounters(http_admission_in_use=0, http_admission_capacity=1, uptime_seconds=0, image_counters={})


def _samples(text: str) -> dict[str, tuple[str, float]]:
    """sample name -> (family type, value) for unlabelled samples."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = (family.type, sample.value)
    return out


def test_prometheus_text_parses_with_spec_names_and_values() -> None:
    text = prometheus_text(VALUES, EMPTY_WINDOW)
    assert text.endswith("\n")
    samples = _samples(text)
    expected = {
        "flare_prefill_tokens_total": ("counter", 120),
        "flare_generated_tokens_total": ("counter", 42),
        "flare_requests_completed_total": ("counter", 3),
        "flare_requests_failed_total": ("counter", 1),
        "flare_cache_reused_tokens_total": ("counter", 64),
        "flare_speculative_rounds_total": ("counter", 9),
        "flare_active_requests": ("gauge", 2),
        "flare_pending_requests": ("gauge", 5),
        "flare_free_kv_pages": ("gauge", 900),
        "flare_total_kv_pages": ("gauge", 1024),
        "flare_cached_kv_pages": ("gauge", 7),
        "flare_kv_page_tokens": ("gauge", 16),
        "flare_decode_weight_bytes": ("gauge", 270_000_000),
        "flare_http_admission_in_use": ("gauge", 4),
        "flare_http_admission_capacity": ("gauge", 512),
        "flare_uptime_seconds": ("gauge", 12.5),
        "flare_input_decoded_images_total": ("counter", 6),
        "flare_host_cache_hits_total": ("counter", 0),
        "flare_history_drafts_enabled": ("gauge", 0),
    }
    for name, value in expected.items():
        assert samples[name] == value, name
    for spec in FIELDS:
        if spec.name is not None:
            assert spec.name in samples, spec.key
    assert all(name.startswith("flare_") for name in samples)
    assert not any("learned_drafter" in name or "draft_steps" in name for name in samples)  # "none" in the table


def test_prometheus_text_has_help_and_type_for_every_family() -> None:
    text = prometheus_text(VALUES, EMPTY_WINDOW)
    names = {line.split()[0] for line in text.splitlines() if not line.startswith("#")}
    for name in names:
        family = name.split("{")[0].removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        family = family if f"# TYPE {family} " in text else name
        assert f"# TYPE {family} " in text and f"# HELP {family} " in text, name


def test_host_cache_histograms_are_the_only_histograms() -> None:
    families = list(text_string_to_metric_families(prometheus_text({}, EMPTY_WINDOW)))
    histograms = {f.name: f for f in families if f.type == "histogram"}
    assert set(histograms) == {
        "flare_host_cache_missing_tokens",
        "flare_host_cache_estimated_transfer_ns",
        "flare_host_cache_estimated_prefill_ns",
    }
    for family in histograms.values():
        values = {(s.name.removeprefix(family.name), s.labels.get("le")): s.value for s in family.samples}
        assert values == {("_bucket", "+Inf"): 0, ("_sum", None): 0, ("_count", None): 0}


def test_first_response_median_is_exported() -> None:
    window = FirstResponseWindow()
    for t, seconds in enumerate([0.5, 0.1, 0.3]):
        window.record(seconds, now=float(t))
    samples = _samples(prometheus_text({}, window.summary(now=3.0)))
    assert samples["flare_first_response_median_seconds"] == ("gauge", 0.3)
    assert samples["flare_first_response_samples"] == ("gauge", 3)


def test_json_snapshot_has_every_field_as_integers() -> None:
    snapshot = json_snapshot({"generated_tokens": 42.0, "active": 2, "uptime_seconds": 1.5}, EMPTY_WINDOW)
    for spec in FIELDS:
        assert spec.key in snapshot
        if spec.key != "learned_drafter":
            assert type(snapshot[spec.key]) is int, spec.key
    assert snapshot["generated_tokens"] == 42 and snapshot["prefill_tokens"] == 0
    assert snapshot["learned_drafter"] is False
    assert snapshot["uptime_seconds"] == 1.5
    assert snapshot["first_response"] == {
        "median_seconds": None,
        "samples": 0,
        "window_seconds": 60,
        "capacity": 4096,
        "truncated": False,
    }


def test_json_snapshot_passes_extras_and_learned_drafter() -> None:
    snapshot = json_snapshot(VALUES, EMPTY_WINDOW)
    assert snapshot["learned_drafter"] is True
    assert snapshot["input_decoded_images_total"] == 6
    assert snapshot["http_admission_capacity"] == 512


def test_first_response_window_keeps_the_last_minute() -> None:
    window = FirstResponseWindow(window_seconds=60, capacity=100)
    window.record(9.0, now=0.0)
    window.record(1.0, now=30.0)
    window.record(2.0, now=40.0)
    assert window.summary(now=50.0)["median_seconds"] == 2.0  # median of 9, 1, 2
    summary = window.summary(now=65.0)  # the sample at t=0 has left the window
    assert summary["samples"] == 2 and summary["median_seconds"] == 1.5
    assert window.summary(now=200.0) == {
        "median_seconds": None,
        "samples": 0,
        "window_seconds": 60,
        "capacity": 100,
        "truncated": False,
    }


def test_first_response_window_reports_truncation_while_drops_are_recent() -> None:
    window = FirstResponseWindow(window_seconds=60, capacity=3)
    for t in range(5):
        window.record(float(t), now=float(t))
    summary = window.summary(now=5.0)
    assert summary["samples"] == 3 and summary["truncated"] is True and summary["median_seconds"] == 3.0
    assert window.summary(now=61.5)["truncated"] is False  # dropped samples (t<=1) would have expired


@pytest.mark.parametrize(
    "accept,expected",
    [
        (None, "prometheus"),
        ("", "prometheus"),
        ("application/json", "json"),
        ("text/plain", "prometheus"),
        ("*/*", "prometheus"),  # one range matches both: a tie at the same position keeps text
        ("application/json, text/plain", "json"),  # equal q: the earlier range wins
        ("text/plain, application/json", "prometheus"),
        ("text/plain;q=0.5, application/json", "json"),
        ("application/json;q=0.5, text/plain", "prometheus"),
        ("application/json;q=0.9, text/plain;q=0.9", "json"),
        ("text/*;q=0.3, application/json;q=0.4", "json"),
        ("application/*, text/plain;q=0.8", "json"),
        ("*/*;q=0.1, application/json;q=0.2", "json"),
        ("text/plain;q=0.2, */*;q=0.9", "json"),  # json 0.9 via */*, text/plain 0.2
        ("text/plain;q=0.1, text/*;q=0.9, application/json;q=0.5", "json"),  # the most specific range sets q
        ("application/json;q=0", "prometheus"),
        ("image/png", "prometheus"),
        ("application/openmetrics-text; version=1.0.0", "prometheus"),
        (
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
            "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,"
            "*/*;q=0.2",
            "prometheus",
        ),  # Prometheus 3 scraper
        ("application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "prometheus"),
        ("APPLICATION/JSON; Q=1", "json"),
    ],
)
def test_accept_negotiation(accept: str | None, expected: str) -> None:
    assert choose_format(None, accept) == expected


@pytest.mark.parametrize(
    "query,accept,expected",
    [
        ("json", "text/plain", "json"),
        ("prometheus", "application/json", "prometheus"),
        ("json", None, "json"),
    ],
)
def test_format_query_overrides_accept(query: str, accept: str | None, expected: str) -> None:
    assert choose_format(query, accept) == expected


@pytest.mark.parametrize("query", ["xml", "", "openmetrics"])
def test_unknown_format_is_rejected(query: str) -> None:
    with pytest.raises(ValueError, match="format"):
        choose_format(query, "application/json")


def test_host_cache_histograms_and_labelled_counters_parse_when_filled() -> None:
    from helios.engine.memory.host_store import HostStats

    stats = HostStats()
    for tokens in (3, 40, 5000):
        stats.missing_tokens.observe(tokens)
    stats.transfer_ns.observe(2e6)
    values = {"host_cache_held": {"dram": 7, "nvme": 5}, "host_cache_dropped": {"nvme/io_error": 1}}
    text = prometheus_text(
        values,
        EMPTY_WINDOW,
        {
            "flare_host_cache_missing_tokens": HistogramSnapshot(tuple(stats.missing_tokens.cumulative()), 5043.0),
            "flare_host_cache_estimated_transfer_ns": HistogramSnapshot(tuple(stats.transfer_ns.cumulative()), 2e6),
        },
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    missing = {
        s.labels.get("le"): s.value
        for s in families["flare_host_cache_missing_tokens"].samples
        if s.name.endswith("_bucket")
    }
    assert missing["4"] == 1 and missing["64"] == 2 and missing["+Inf"] == 3
    held = {s.labels["tier"]: s.value for s in families["flare_host_cache_held"].samples}
    assert held == {"dram": 7, "nvme": 5}
    dropped = {(s.labels["tier"], s.labels["reason"]): s.value for s in families["flare_host_cache_dropped"].samples}
    assert dropped[("nvme", "io_error")] == 1 and sum(dropped.values()) == 1  # the other five pairs read zero


def test_checkpoint_counters_reach_prometheus_and_json() -> None:
    """The engine's checkpoint counters as the server exports them (api.md: roles, skip reasons and
    the charged predicted extra work)."""
    engine = engine_metrics(
        checkpoint_captures=(("anchor", 2), ("message", 5)),
        checkpoint_skips=(("unknown_cost", 1), ("work_budget", 3)),
        checkpoint_extra_work_ns=123_456,
        checkpoint_anchor_reservations=3,
        graph_launches=(("eager", 2), ("graph", 7)),
    )
    server = ServerCounters(0, 1, 0, {"input_decoded_images_total": 2})
    values = values_of(engine, server)
    assert values["input_decoded_images_total"] == 2 and values["input_vision_encodes_total"] == 0
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(values, EMPTY_WINDOW))}
    captures = {s.labels["role"]: s.value for s in families["flare_checkpoint_captures"].samples}
    skips = {s.labels["reason"]: s.value for s in families["flare_checkpoint_skips"].samples}
    assert captures == {"anchor": 2, "message": 5, "endpoint": 0}  # every role api.md names, zero until counted
    assert skips == {"unknown_cost": 1, "work_budget": 3, "storage": 0}
    work = families["flare_checkpoint_extra_work_nanoseconds"]
    assert work.type == "counter" and work.samples[0].value == 123_456
    snapshot = json_snapshot(values, EMPTY_WINDOW)
    assert snapshot["checkpoint_extra_work_nanoseconds_total"] == 123_456
    assert snapshot["checkpoint_captures"] == {"anchor": 2, "message": 5}
    reservations = families["flare_checkpoint_anchor_reservations"]
    assert reservations.type == "gauge" and reservations.samples[0].value == 3
    assert snapshot["checkpoint_anchor_reservations"] == 3
    launches = families["flare_graph_launches"]  # docs/serving.md: step launches by kind
    assert launches.type == "counter" and {s.labels["kind"]: s.value for s in launches.samples} == {
        "graph": 7,
        "eager": 2,
    }
    assert snapshot["graph_launches"] == {"graph": 7, "eager": 2}


def test_host_copy_out_counters_reach_prometheus_and_json() -> None:
    """The copy-out and anchor counters of the host store as the server exports them."""
    host = host_metrics(
        copyout_waits=2,
        copyout_wait_ns=5_000,
        copyout_worker_ns=9_000,
        copyout_pinned_records=3,
        dropped=(("dram/end_of_chain", 7),),
    )
    values = values_of(
        engine_metrics(host=host, checkpoint_slots_in_use=5, checkpoint_slots_total=40, checkpoint_intake_slots=8),
        SERVER,
    )
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(values, EMPTY_WINDOW))}
    assert families["flare_host_cache_copyout_waits"].type == "counter"
    assert families["flare_host_cache_copyout_waits"].samples[0].value == 2
    assert families["flare_host_cache_copyout_wait_nanoseconds"].samples[0].value == 5_000
    assert families["flare_host_cache_copyout_worker_nanoseconds"].samples[0].value == 9_000
    assert families["flare_host_cache_copyout_pinned_records"].type == "gauge"
    assert families["flare_host_cache_copyout_pinned_records"].samples[0].value == 3
    assert families["flare_host_cache_anchor_records"].samples[0].value == 0
    dropped = {(s.labels["tier"], s.labels["reason"]): s.value for s in families["flare_host_cache_dropped"].samples}
    assert dropped[("dram", "end_of_chain")] == 7 and sum(dropped.values()) == 7 and len(dropped) == 6
    snapshot = json_snapshot(values, EMPTY_WINDOW)
    assert snapshot["host_cache_copyout_waits_total"] == 2 and snapshot["host_cache_copyout_pinned_records"] == 3
    assert snapshot["host_cache_dropped"] == {"dram/end_of_chain": 7}


def test_every_sample_agrees_with_the_json_form() -> None:
    """Both expositions of one busy snapshot (host store, drafts, images, checkpoints) say the same,
    sample by sample, and the text covers every JSON number."""
    busy = HistogramSnapshot((("1", 1), ("4", 3), ("+Inf", 4)), 77.5)
    host = host_metrics(
        hits=3,
        reused_tokens=640,
        memory_records=9,
        disk_records=4,
        bytes_out=1 << 40,
        held=(("dram", 9), ("nvme", 4)),
        dropped=(("nvme/io_error", 1), ("dram/oversize", 2)),
        copyout_worker_ns=12_345,
        missing_tokens=busy,
        estimated_prefill_ns=HistogramSnapshot((("1e+04", 0), ("+Inf", 2)), 3e4),
    )
    engine = engine_metrics(
        prefill_tokens=1200,
        generated_tokens=420,
        active=3,
        free_pages=100,
        total_pages=128,
        cached_pages=20,
        verify_steps=30,
        accepted_drafts=17,
        rounds_by_depth=((0, 4), (3, 9)),
        steps_by_batch=((1, 20), (2, 10)),
        steps_by_width=((4, 30),),
        learned_drafter="mtp",
        history_drafts_enabled=True,
        images=tuple((name, index) for index, name in enumerate(IMAGE_COUNTERS)),
        checkpoint_captures=(("endpoint", 6),),
        graph_launches=(("eager", 3), ("graph", 27)),
        host=host,
    )
    window = FirstResponseWindow()
    window.record(0.25, now=0.0)
    values = values_of(engine, ServerCounters(5, 64, 99, {"input_decoded_images_total": 2}))
    first, histograms = window.summary(now=1.0), histograms_of(engine)
    snapshot = json_snapshot(values, first, histograms)
    assert snapshot["speculative_rounds_depth_3_total"] == 9 and snapshot["used_pages"] == 8
    assert snapshot["learned_drafter"] is True and snapshot["learned_drafter_name"] == "mtp"
    assert snapshot["host_cache_missing_tokens"] == {"buckets": {"1": 1, "4": 3, "+Inf": 4}, "count": 4, "sum": 77.5}
    assert expositions_disagree(prometheus_text(values, first, histograms), snapshot) == []
    idle = values_of(engine_metrics(), SERVER)  # no host store, no first responses: NaN median, empty histograms
    assert expositions_disagree(prometheus_text(idle, EMPTY_WINDOW), json_snapshot(idle, EMPTY_WINDOW)) == []


def test_a_wrong_sample_is_reported() -> None:
    values = values_of(engine_metrics(generated_tokens=5), SERVER)
    text = prometheus_text(values, EMPTY_WINDOW).replace(
        "flare_generated_tokens_total 5.0", "flare_generated_tokens_total 6.0"
    )
    assert expositions_disagree(text, json_snapshot(values, EMPTY_WINDOW)) == [
        "flare_generated_tokens_total: text 6.0, JSON generated_tokens 5"
    ]
