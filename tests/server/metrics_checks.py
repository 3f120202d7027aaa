"""Checks shared by the /metrics tests: snapshots made by hand, and both expositions compared
sample by sample."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from helios.engine import IMAGE_COUNTERS, EngineMetrics, HistogramSnapshot, HostStoreMetrics
from helios.server.metrics import FIELDS, HISTOGRAMS, LABELLED


def engine_metrics(**changes: Any) -> EngineMetrics:
    """An idle CPU engine's snapshot (every count zero, every image counter listed), with `changes`."""
    values: dict[str, Any] = {
        f.name: () if "Counts" in f.type or "tuple" in f.type else 0 for f in fields(EngineMetrics)
    }
    values.update(
        device="cpu",
        step_kind="portable",
        cuda_graphs=False,
        upcast_from=None,
        attention_kernels="python",
        learned_drafter=None,
        history_drafts_enabled=False,
        images=tuple((name, 0) for name in IMAGE_COUNTERS),
        graph_launches=(("eager", 0), ("graph", 0)),
        host=None,
    )
    return EngineMetrics(**(values | changes))


def host_metrics(**changes: Any) -> HostStoreMetrics:
    """An empty host prefix store's part of the snapshot, with `changes`."""
    empty = HistogramSnapshot((("+Inf", 0),), 0.0)
    values: dict[str, Any] = {f.name: 0 for f in fields(HostStoreMetrics)}
    values.update(
        held=(("dram", 0), ("nvme", 0)),
        dropped=(),
        missing_tokens=empty,
        estimated_transfer_ns=empty,
        estimated_prefill_ns=empty,
    )
    return HostStoreMetrics(**(values | changes))


def expositions_disagree(text: str, snapshot: dict, skip: frozenset[str] = frozenset()) -> list[str]:
    """Every sample of the Prometheus text against the JSON object built from the same values, and
    every number of the JSON object against the text: what disagrees ([] when both say the same).
    Samples named in `skip` (unlabelled ones, whose JSON key is the name without flare_) are not compared."""
    table = {spec.metric: spec.key for spec in FIELDS if spec.name is not None}
    labelled = {spec.metric.removesuffix("_total"): (spec.key, spec.labels) for spec in LABELLED}
    histograms = {name for name, _ in HISTOGRAMS}
    first = {"flare_first_response_median_seconds": "median_seconds", "flare_first_response_samples": "samples"}
    bad, seen = [], set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in skip:
                seen.add(sample.name.removeprefix("flare_"))
                continue
            if family.name in histograms:
                key = family.name.removeprefix("flare_")
                part = snapshot[key]
                suffix = sample.name.removeprefix(family.name)
                expected = part["buckets"][sample.labels["le"]] if suffix == "_bucket" else part[suffix[1:]]
            elif family.name in labelled:
                key, labels = labelled[family.name]
                expected = snapshot[key].get("/".join(sample.labels[label] for label in labels), 0)
            elif sample.name in first:
                key = "first_response"
                expected = snapshot[key][first[sample.name]]
                expected = math.nan if expected is None else expected
            else:
                key = table.get(sample.name, sample.name.removeprefix("flare_"))
                expected = snapshot.get(key, 0)  # extras absent from JSON (no host store) read as zero
            seen.add(key)
            same = math.isnan(sample.value) if isinstance(expected, float) and math.isnan(expected) else None
            if not (same if same is not None else sample.value == expected):
                bad.append(f"{sample.name}{sample.labels or ''}: text {sample.value}, JSON {key} {expected}")
    json_only = {"learned_drafter", "learned_drafter_name", "draft_steps"}  # api.md: none in the text
    bad += [f"JSON {key} has no sample" for key in snapshot if key not in seen | json_only]
    return bad
