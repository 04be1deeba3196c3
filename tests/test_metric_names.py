"""Metric names and batch-bucket labels have one source, ``service.metric_names``:
the service exports exactly those names, the dashboards and docs name only
those, the dashboards' speedup is the metrics module's PromQL, and the
buckets the controller decides for are the labels the metrics module writes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import service.metrics
from service.controller import BUCKETS
from service.controller.loop import ControllerMetrics
from service.metric_names import METRIC_NAMES, STEP_SECONDS
from service.metrics import Metrics, achieved_speedup_promql, fleet_achieved_speedup_promql
from speculative.session import RoundStats

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")  # what Prometheus appends to a base name
# Words with the prefix that name no metric: SGLang plugin hooks and RPCs, a
# draft-config key, an SGLang source file.
NOT_METRICS = {"dflash_adaptive", "dflash_config", "dflash_probe", "dflash_set_policy", "dflash_utils"}
# A whole word (not ``apply_dflash_...`` nor ``x.dflash_...``), without a trailing
# "_" (``dflash_step_seconds_{sum,count}`` names dflash_step_seconds).
NAME = re.compile(r"(?<![\w.])dflash_[a-z0-9_]*[a-z0-9]")


def is_defined(name: str) -> bool:
    return name in METRIC_NAMES or any(name.endswith(s) and name.removesuffix(s) in METRIC_NAMES for s in SUFFIXES)


def strings(node: Any) -> Iterator[str]:
    """Every string in a JSON document (PromQL sits in panels and template variables)."""
    if isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)
    elif isinstance(node, str):
        yield node


def mentioned(text: str) -> set[str]:
    return set(NAME.findall(text)) - NOT_METRICS


def test_the_service_exports_exactly_the_defined_names():
    registry = CollectorRegistry()
    Metrics(registry)
    ControllerMetrics(registry)
    assert {family.name for family in registry.collect()} == METRIC_NAMES


def test_dashboards_name_only_defined_metrics():
    used = set()
    for dashboard in (ROOT / "dashboards").glob("*.json"):
        used |= {name for text in strings(json.loads(dashboard.read_text())) for name in mentioned(text)}
    assert len(used) >= 15
    assert {name for name in used if not is_defined(name)} == set()


def test_the_dashboards_speedup_is_the_one_the_metrics_module_defines():
    """The achieved-speedup panels run ``service.metrics``' PromQL with
    Grafana's window and variables: what the tests check is what users see."""
    panels = json.loads((ROOT / "dashboards" / "dflash.json").read_text())["panels"]
    exprs = {p["title"]: p["targets"][0]["expr"] for p in panels if p.get("targets")}
    variables = 'model=~"$model", instance=~"$instance"'
    assert exprs["Speedup over plain decoding: achieved and estimated"] == achieved_speedup_promql(
        "$__rate_interval", variables
    )
    assert exprs["Achieved speedup (time range, fleet)"] == fleet_achieved_speedup_promql("$__range", variables)


def test_docs_name_only_defined_metrics():
    docs = [p for p in (ROOT / "docs").glob("*.md") if p.name != "LOG.md"] + [ROOT / "README.md"]
    used = {(path.name, name) for path in docs for name in mentioned(path.read_text())}
    used |= {("service/metrics.py", name) for name in mentioned(service.metrics.__doc__ or "")}  # its PromQL
    assert len(used) >= 15
    assert {(path, name) for path, name in used if not is_defined(name)} == set()


def test_the_controllers_buckets_are_the_labels_the_metrics_write():
    metrics = Metrics()
    for batch in range(1, 200):
        metrics.observe_profile_step(RoundStats(batch, 1, [1] * batch, [], [], 0.0, 0.01), 0.01)
    written = {
        sample.labels["batch_bucket"]
        for family in metrics.registry.collect()
        if family.name == STEP_SECONDS
        for sample in family.samples
    }
    assert written == set(BUCKETS)
    assert BUCKETS == ("1", "2-3", "4-7", "8-15", "16-31", "32-63", "64+")  # smallest batch first
