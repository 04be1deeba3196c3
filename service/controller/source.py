"""Where observations come from: the service's own metric objects (the
in-process controller), Prometheus exposition text (replicas' ``/metrics``,
summed) or a Prometheus server's HTTP API (PromQL instant queries summed over
every scraped replica)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx2
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from service import metric_names as names
from service.controller.estimates import Observation

# The samples the controller reads: a histogram's _sum and _count, counters' _total.
STEP_SUM = f"{names.STEP_SECONDS}_sum"
STEP_COUNT = f"{names.STEP_SECONDS}_count"
ACCEPTED = f"{names.ACCEPTED_PER_POSITION}_total"
VERIFIED = f"{names.VERIFIED_PER_POSITION}_total"
LOOKUP = f"{names.LOOKUP_ACCEPTED_TOKENS}_total"
ROWS = f"{names.VERIFY_ROWS}_total"


class SourceError(RuntimeError):
    """An observation could not be read or made sense of."""


def observation_from_text(texts: Iterable[str], now: float) -> Observation:
    """Sum the counters of several replicas' exposition texts."""
    return _observation((f for text in texts for f in text_string_to_metric_families(text)), now)


def observation_from_collectors(collectors: Iterable[Collector], now: float) -> Observation:
    """The counters straight from this process's metric objects: the same
    numbers as rendering and parsing ``/metrics``, at a tenth of the cost (all
    of it holding the GIL the engine's loop needs), so the in-process
    controller can look often."""
    return _observation((family for collector in collectors for family in collector.collect()), now)


def _observation(families: Iterable[Metric], now: float) -> Observation:
    """Fold every sample in (lazily parsed families raise while iterated)."""
    counts = _Counts()
    try:
        for family in families:
            for sample in family.samples:
                counts.fold(sample.name, sample.labels, sample.value)
    except (ValueError, KeyError) as exc:
        raise SourceError(f"unreadable metrics: {exc}") from exc
    return counts.observation(now)


def scrape_replicas(urls: Iterable[str], now: float, timeout: float = 5.0) -> Observation:
    """GET ``/metrics`` of every replica and sum them."""
    texts = []
    for url in urls:
        try:
            response = httpx2.get(url.rstrip("/") + "/metrics", timeout=timeout)
            response.raise_for_status()
        except httpx2.HTTPError as exc:
            raise SourceError(f"cannot scrape {url}: {exc}") from exc
        texts.append(response.text)
    return observation_from_text(texts, now)


def query_prometheus(base_url: str, now: float, timeout: float = 5.0) -> Observation:
    """The same counters through PromQL, summed over replicas."""
    queries = {
        STEP_SUM: f"sum by (block_size, batch_bucket) ({STEP_SUM})",
        STEP_COUNT: f"sum by (block_size, batch_bucket) ({STEP_COUNT})",
        ACCEPTED: f"sum by (position) ({ACCEPTED})",
        VERIFIED: f"sum by (position) ({VERIFIED})",
        LOOKUP: f"sum by (block_size) ({LOOKUP})",
        ROWS: f"sum by (block_size) ({ROWS})",
    }
    counts = _Counts()
    # One evaluation time for all the queries: evaluated at "now" one after the
    # other, a histogram's _sum and _count could come from different scrapes.
    at = time.time()
    for name, query in queries.items():
        for series in instant_query(base_url, query, timeout, at):
            try:
                value = float(series["value"][1])
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                raise SourceError(f"malformed sample in {name}: {series!r}") from exc
            counts.fold(name, series.get("metric", {}), value)
    return counts.observation(now)


def instant_query(base_url: str, query: str, timeout: float = 5.0, at: float | None = None) -> list[dict[str, Any]]:
    """The result vector of a PromQL instant query, evaluated at Unix time ``at``
    (default: Prometheus' now); SourceError on any failure."""
    params = {"query": query} if at is None else {"query": query, "time": f"{at:.3f}"}
    try:
        response = httpx2.get(base_url.rstrip("/") + "/api/v1/query", params=params, timeout=timeout)
        response.raise_for_status()
        payload = response.json()
        if payload.get("status") != "success":
            raise SourceError(f"prometheus answered {payload.get('status')!r}: {payload.get('error')}")
        return list(payload["data"]["result"])
    except (httpx2.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"prometheus query failed: {exc}") from exc


def discover_replicas(base_url: str, query: str, timeout: float = 5.0) -> list[str]:
    """Base URLs (``http://<instance>``) of the series ``query`` returns with a
    positive value, e.g. ``up{job="dflash-serve"}``: the replicas Prometheus
    currently scrapes successfully."""
    urls = set()
    for series in instant_query(base_url, query, timeout):
        instance = series.get("metric", {}).get("instance")
        try:
            up = float(series["value"][1]) > 0
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise SourceError(f"malformed sample for {query}: {series!r}") from exc
        if instance and up:
            urls.add(f"http://{instance}")
    return sorted(urls)


@dataclass
class _Counts:
    """The counters an observation needs, summed over series (and replicas)."""

    steps: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    accepted: dict[int, float] = field(default_factory=dict)
    verified: dict[int, float] = field(default_factory=dict)
    lookup_accepted: dict[int, float] = field(default_factory=dict)
    drafting_rows: dict[int, float] = field(default_factory=dict)

    def fold(self, name: str, labels: dict[str, str], value: float) -> None:
        if not math.isfinite(value) or value < 0:
            raise SourceError(f"{name}{labels} = {value} is not a counter value")
        if name in (STEP_SUM, STEP_COUNT):
            cell = (labels["batch_bucket"], int(labels["block_size"]))
            pair = self.steps.setdefault(cell, [0.0, 0.0])
            pair[0 if name == STEP_SUM else 1] += value
        elif name == ACCEPTED:
            self.accepted[int(labels["position"])] = self.accepted.get(int(labels["position"]), 0.0) + value
        elif name == VERIFIED:
            self.verified[int(labels["position"])] = self.verified.get(int(labels["position"]), 0.0) + value
        elif name == LOOKUP:
            b = int(labels["block_size"])
            self.lookup_accepted[b] = self.lookup_accepted.get(b, 0.0) + value
        elif name == ROWS and int(labels["block_size"]) > 1:
            b = int(labels["block_size"])
            self.drafting_rows[b] = self.drafting_rows.get(b, 0.0) + value

    def observation(self, now: float) -> Observation:
        steps = {cell: (total, count) for cell, (total, count) in self.steps.items()}
        return Observation(now, steps, self.accepted, self.verified, self.lookup_accepted, self.drafting_rows)
