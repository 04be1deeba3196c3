"""Every Prometheus object of the service (named in ``service.metric_names``),
fed from engine ``RoundStats`` and request timings. Only raw counters,
histograms and gauges are exported; rates and ratios are derived in PromQL
(the dashboards use exactly these):

Mean acceptance length (tokens committed per verify round and request: the
draft's accepted tokens and n-gram lookup's beyond them, plus the bonus; add
``by (block_size)`` to every sum for one curve per block size):
    (sum(rate(dflash_accepted_tokens_total[1m])) + sum(rate(dflash_verify_rows_total[1m])))
      / sum(rate(dflash_verify_rows_total[1m]))
Survival / acceptance at draft position k (correct when b changes, because
only rows that verified a draft at position k count in the denominator):
    rate(dflash_accepted_tokens_per_position_total{position="k"}[5m])
      / rate(dflash_verified_tokens_per_position_total{position="k"}[5m])
Draft acceptance rate (the draft's own slots; lookup paths are not drafts):
    sum(rate(dflash_accepted_tokens_per_position_total[5m]))
      / sum(rate(dflash_verified_tokens_per_position_total[5m]))
Share of accepted tokens that n-gram lookup added (``--lookup``):
    sum(rate(dflash_lookup_accepted_tokens_total[5m])) / sum(rate(dflash_accepted_tokens_total[5m]))
Achieved speedup over plain decoding per batch bucket (``ACHIEVED_SPEEDUP``
below): the seconds plain decoding would have taken for what the bucket did
over the seconds it took. Both include the bucket's prefills (a prefill
stalls every running row; it is filed under the batch size it leaves, and
costs plain decoding the same); the steps took their serving step time,
plain decoding would have taken the tokens they output over its tokens per
second at the same bucket. A plain step commits one token per row, so plain
decoding's rate is rows per second of b = 1 steps: the served ones in the
window (plain steps, the controller's paired trials) where there are any,
else the start-up profile's (cumulative: it ran once). Assumes the bucket's
mix of batch sizes and contexts is alike in both (true for served b = 1
steps; the profile uses short random prompts). Fleet-wide
(``FLEET_ACHIEVED_SPEEDUP``): the same seconds summed over the buckets that
have a plain-decoding rate. An engine that reports no prefill time (SGLang)
counts steps only.
Refused requests per second by reason (queue_full = 429, draining = 503,
invalid = 400, ...):
    sum by (reason) (rate(dflash_refused_requests_total[1m]))
Requests preempted per second (taken out of a batch that would pass
``--max-batch-slots``, resumed later by prefilling their text):
    rate(dflash_preemptions_total[5m])
Step time by block size and batch bucket (the controller's cost model):
    rate(dflash_step_seconds_sum[5m]) / rate(dflash_step_seconds_count[5m])
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service import metric_names as names
from service.metric_names import BUCKETS
from service.metric_names import batch_bucket as batch_bucket  # re-exported: the label of a batch size
from speculative.session import RoundStats


def _series(name: str, selector: str, *labels: str) -> str:
    """``name{selector, labels}`` (either part may be empty)."""
    inside = ", ".join(part for part in (selector, *labels) if part)
    return f"{name}{{{inside}}}" if inside else name


def _by_bucket(series: str, window: str | None, function: str = "rate") -> str:
    """``sum by (batch_bucket)`` of ``function(series[window])``, or of the
    cumulative values when ``window`` is None."""
    return f"sum by (batch_bucket) ({series if window is None else f'{function}({series}[{window}])'})"


def _ratio_by_bucket(numerator: str, denominator: str, window: str | None) -> str:
    """One series' rates by bucket over the other's (cumulative values when ``window`` is None)."""
    return f"{_by_bucket(numerator, window)} / {_by_bucket(denominator, window)}"


def _plain_rate(window: str, selector: str) -> str:
    b1 = 'block_size="1"'
    served = _ratio_by_bucket(
        _series(f"{names.SERVED_STEP_ROWS}_total", selector, b1),
        _series(f"{names.SERVED_STEP_SECONDS}_total", selector, b1),
        window,
    )
    profiled = _ratio_by_bucket(
        _series(f"{names.PROFILE_STEP_ROWS}_total", selector, b1),
        _series(f"{names.PROFILE_STEP_SECONDS}_total", selector, b1),
        None,
    )
    return f"(({served}) > 0 or ({profiled}))"


def _speedup_terms(window: str, selector: str, function: str) -> tuple[str, str, str]:
    """(prefill seconds, serving step seconds, output tokens) by bucket over
    ``window``; prefill reads 0 on a server that exports none."""
    steps = _by_bucket(_series(f"{names.SERVED_STEP_SECONDS}_total", selector), window, function)
    prefill = _by_bucket(_series(f"{names.PREFILL_SECONDS}_total", selector), window, function)
    tokens = _by_bucket(_series(f"{names.STEP_OUTPUT_TOKENS}_total", selector), window, function)
    return f"({prefill} or {steps} * 0)", steps, tokens


def achieved_speedup_promql(window: str = "5m", selector: str = "") -> str:
    """PromQL of the achieved speedup per ``batch_bucket`` over ``window``, of
    the series ``selector`` picks (e.g. ``instance="a:8000"``; empty: all)."""
    prefill, steps, tokens = _speedup_terms(window, selector, "rate")
    plain = _plain_rate(window, selector)
    return f"({prefill} + {tokens} / on (batch_bucket) {plain}) / ({prefill} + {steps})"


def fleet_achieved_speedup_promql(window: str = "1h", selector: str = "") -> str:
    """PromQL of the fleet-wide achieved speedup over ``window``: the seconds
    plain decoding would have needed for each bucket's prefills and tokens,
    summed, over the seconds they took, in the buckets that have a
    plain-decoding rate."""
    prefill, steps, tokens = _speedup_terms(window, selector, "increase")
    plain = _plain_rate(window, selector)
    needed = f"{prefill} + {tokens} / on (batch_bucket) {plain}"
    took = f"({prefill} + {steps}) and on (batch_bucket) {plain}"
    return f"sum({needed}) / sum({took})"


ACHIEVED_SPEEDUP = achieved_speedup_promql()
FLEET_ACHIEVED_SPEEDUP = fleet_achieved_speedup_promql()


SpeedupCounters = dict[tuple[str, str, str], float]
"""Counter values (or their increase over a window) keyed (metric name, block size, batch bucket)."""
PROFILE_COUNTERS = (names.PROFILE_STEP_SECONDS, names.PROFILE_STEP_ROWS)
SPEEDUP_COUNTERS = (
    names.SERVED_STEP_SECONDS,
    names.SERVED_STEP_ROWS,
    names.STEP_OUTPUT_TOKENS,
    names.PREFILL_SECONDS,
    *PROFILE_COUNTERS,
)


def speedup_counters(exposition: str) -> SpeedupCounters:
    """The achieved speedup's counters on a ``/metrics`` page (none on a server
    that does not export them)."""
    counters = {}
    for family in text_string_to_metric_families(exposition):
        if family.name in SPEEDUP_COUNTERS:
            for sample in family.samples:
                if sample.name == family.name + "_total":
                    block = sample.labels.get("block_size", "")  # prefill has none
                    counters[(family.name, block, sample.labels["batch_bucket"])] = sample.value
    return counters


def counters_between(before: SpeedupCounters, after: SpeedupCounters) -> SpeedupCounters:
    """What serving added between two scrapes; the start-up profile's counters
    stay whole (it ran once, before serving), as the PromQL reads them."""
    return {key: value if key[0] in PROFILE_COUNTERS else value - before.get(key, 0.0) for key, value in after.items()}


def _total(counters: SpeedupCounters, metric: str, bucket: str, block: str | None = None) -> float:
    return sum(v for (m, b, k), v in counters.items() if m == metric and k == bucket and block in (None, b))


def plain_rates(counters: SpeedupCounters) -> dict[str, float]:
    """Plain decoding's output tokens (= rows) per step-second per bucket: its
    served b = 1 steps where there are any, else the start-up profile's."""
    rates = {}
    for bucket in sorted({k for _, _, k in counters}):
        for rows, seconds in ((names.SERVED_STEP_ROWS, names.SERVED_STEP_SECONDS), PROFILE_COUNTERS[::-1]):
            if _total(counters, seconds, bucket, "1") > 0 and _total(counters, rows, bucket, "1") > 0:
                rates[bucket] = _total(counters, rows, bucket, "1") / _total(counters, seconds, bucket, "1")
                break
    return rates


def _seconds(counters: SpeedupCounters, bucket: str, plain: float) -> tuple[float, float]:
    """(seconds plain decoding would have taken, seconds taken) for the bucket's
    prefills and serving steps."""
    prefill = _total(counters, names.PREFILL_SECONDS, bucket)
    needed = prefill + _total(counters, names.STEP_OUTPUT_TOKENS, bucket) / plain
    return needed, prefill + _total(counters, names.SERVED_STEP_SECONDS, bucket)


def achieved_speedup(counters: SpeedupCounters) -> dict[str, float]:
    """The achieved speedup per bucket, as ``ACHIEVED_SPEEDUP`` computes it;
    buckets without a plain-decoding rate or serving steps are left out."""
    speedups = {}
    for bucket, plain in plain_rates(counters).items():
        if _total(counters, names.SERVED_STEP_SECONDS, bucket) > 0:
            needed, took = _seconds(counters, bucket, plain)
            speedups[bucket] = needed / took
    return speedups


def overall_achieved_speedup(counters: SpeedupCounters) -> float | None:
    """All buckets together, as ``FLEET_ACHIEVED_SPEEDUP`` computes it: the
    seconds plain decoding would have needed for each bucket's prefills and
    output, summed, over the seconds they took (None without a plain-decoding
    rate)."""
    seconds = [_seconds(counters, bucket, rate) for bucket, rate in plain_rates(counters).items()]
    took = sum(t for _, t in seconds)
    return sum(n for n, _ in seconds) / took if took > 0 else None


STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The service's metrics on their own registry (one per app)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.verify_steps = Counter(
            names.VERIFY_STEPS, "Engine steps (one draft + one target forward)", ["block_size"], registry=r
        )
        self.verify_rows = Counter(
            names.VERIFY_ROWS, "Row-rounds verified (requests x steps)", ["block_size"], registry=r
        )
        self.draft_tokens = Counter(names.DRAFT_TOKENS, "Drafted tokens verified", ["block_size"], registry=r)
        self.accepted_tokens = Counter(
            names.ACCEPTED_TOKENS,
            "Tokens accepted after the anchor: the draft's, and n-gram lookup's beyond them",
            ["block_size"],
            registry=r,
        )
        self.accepted_per_position = Counter(
            names.ACCEPTED_PER_POSITION, "Drafts accepted at block position", ["position"], registry=r
        )
        self.verified_per_position = Counter(
            names.VERIFIED_PER_POSITION, "Drafts verified at block position", ["position"], registry=r
        )
        self.branch_accepted_tokens = Counter(
            names.BRANCH_ACCEPTED_TOKENS,
            "First-slot alternates accepted in place of the chain's first draft (--branches; also in accepted tokens)",
            ["block_size"],
            registry=r,
        )
        self.lookup_accepted_tokens = Counter(
            names.LOOKUP_ACCEPTED_TOKENS,
            "Tokens an n-gram lookup path committed beyond what the draft's slots accepted (--lookup; also in "
            "accepted tokens)",
            ["block_size"],
            registry=r,
        )
        self.step_seconds = Histogram(
            names.STEP_SECONDS, "Engine step time", ["block_size", "batch_bucket"], buckets=STEP_BUCKETS, registry=r
        )
        self.block_size = Gauge(names.BLOCK_SIZE, "Block size of the latest step", registry=r)
        cell = ["block_size", "batch_bucket"]
        self.served_seconds = Counter(
            names.SERVED_STEP_SECONDS, "Step seconds while serving (not the start-up profile)", cell, registry=r
        )
        self.served_rows = Counter(names.SERVED_STEP_ROWS, "Rows stepped while serving", cell, registry=r)
        self.output_tokens = Counter(
            names.STEP_OUTPUT_TOKENS, "Tokens serving steps gave requests (accepted drafts + bonus)", cell, registry=r
        )
        self.profile_seconds = Counter(names.PROFILE_STEP_SECONDS, "Start-up profile step seconds", cell, registry=r)
        self.profile_rows = Counter(names.PROFILE_STEP_ROWS, "Rows stepped by the start-up profile", cell, registry=r)
        self.prefill_seconds = Counter(
            names.PREFILL_SECONDS, "Prefill seconds, by the batch size it leaves running", ["batch_bucket"], registry=r
        )
        for bucket in BUCKETS:  # at zero from the start, as declare_blocks sets the step counters
            self.prefill_seconds.labels(bucket)
        self.running = Gauge(names.RUNNING_REQUESTS, "Requests being decoded", registry=r)
        self.waiting = Gauge(names.WAITING_REQUESTS, "Requests waiting for a slot", registry=r)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Generated tokens (as produced)", registry=r)
        self.requests = Counter(names.REQUESTS, "Finished requests", ["finish_reason"], registry=r)
        self.refused = Counter(
            names.REFUSED_REQUESTS, "Requests refused before decoding, by reason", ["reason"], registry=r
        )
        self.preemptions = Counter(
            names.PREEMPTIONS, "Requests preempted to keep the batch within its cache slots", registry=r
        )
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN, "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            names.INTER_TOKEN_LATENCY,
            "Time between a request's output deltas",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(names.E2E_REQUEST_LATENCY, "Request latency", buckets=LATENCY_BUCKETS, registry=r)

    def declare_blocks(self, block_sizes: Iterable[int]) -> None:
        """Export the serving counters of these blocks at every bucket at zero
        before any step runs: Prometheus then sees each series start from 0, so
        ``rate()`` over a run's first seconds is exact instead of extrapolated
        from whatever the first scrape caught."""
        for b in block_sizes:
            for bucket in BUCKETS:
                for counter in (self.served_seconds, self.served_rows, self.output_tokens):
                    counter.labels(str(b), bucket)

    def controller_inputs(self) -> tuple[Histogram | Counter, ...]:
        """The metrics the block-size controller reads (step time per cell,
        acceptance per position, lookup's tokens and the row-rounds they came from)."""
        return (
            self.step_seconds,
            self.accepted_per_position,
            self.verified_per_position,
            self.lookup_accepted_tokens,
            self.verify_rows,
        )

    def observe_step(self, stats: RoundStats, seconds: float, output_tokens: int | None = None) -> None:
        """Account one engine step (called on the scheduler thread); its rows
        output ``output_tokens`` (after cuts at stops and length limits)."""
        self.observe_steps(stats, seconds, 1, output_tokens)

    def observe_steps(self, stats: RoundStats, seconds: float, steps: int, output_tokens: int | None = None) -> None:
        """Account ``steps`` steps of one batch size and block size, summed in
        ``stats`` (per-position counts) and ``seconds`` (engines that report
        aggregates, e.g. SGLang's schedulers; each step is observed at the mean
        time, so the histogram's sum and count are exact). Without
        ``output_tokens``: every row's accepted tokens and bonus token (what it
        committed; a request's last round may commit a few past its end)."""
        b = str(stats.block_size)
        bucket = batch_bucket(stats.batch_size)
        self.verify_steps.labels(b).inc(steps)
        self.verify_rows.labels(b).inc(stats.batch_size * steps)
        for _ in range(steps):
            self._observe_step_time(stats, seconds / steps)
        self.served_seconds.labels(b, bucket).inc(seconds)
        self.served_rows.labels(b, bucket).inc(stats.batch_size * steps)
        if output_tokens is None:
            output_tokens = sum(stats.accepted_per_position) + stats.lookup_accepted + stats.batch_size * steps
        self.output_tokens.labels(b, bucket).inc(output_tokens)
        self.block_size.set(stats.block_size)
        if stats.block_size > 1:
            self.draft_tokens.labels(b).inc(sum(stats.verified_per_position))
            self.accepted_tokens.labels(b).inc(sum(stats.accepted_per_position) + stats.lookup_accepted)
            self.branch_accepted_tokens.labels(b).inc(stats.branches_taken)
            self.lookup_accepted_tokens.labels(b).inc(stats.lookup_accepted)
            for k, (accepted, verified) in enumerate(
                zip(stats.accepted_per_position, stats.verified_per_position, strict=True), start=1
            ):
                self.accepted_per_position.labels(str(k)).inc(accepted)
                self.verified_per_position.labels(str(k)).inc(verified)

    def observe_prefill(self, batch_size: int, seconds: float) -> None:
        """Account a prefill that left ``batch_size`` rows running (its joining
        requests' first tokens included)."""
        self.prefill_seconds.labels(batch_bucket(batch_size)).inc(seconds)

    def observe_preemptions(self, requests: int) -> None:
        self.preemptions.inc(requests)

    def observe_profile_step(self, stats: RoundStats, seconds: float) -> None:
        """Account a start-up profile step: its time (the controller's first
        observation of the step histogram is the profile) and, for the achieved
        speedup, its rows; its acceptance on random prompts is not real."""
        self._observe_step_time(stats, seconds)
        labels = (str(stats.block_size), batch_bucket(stats.batch_size))
        self.profile_seconds.labels(*labels).inc(seconds)
        self.profile_rows.labels(*labels).inc(stats.batch_size)

    def _observe_step_time(self, stats: RoundStats, seconds: float) -> None:
        self.step_seconds.labels(str(stats.block_size), batch_bucket(stats.batch_size)).observe(seconds)

    def observe_request(self, *, prompt_tokens: int, finish_reason: str, e2e: float) -> None:
        """Account one finished (or aborted) request."""
        self.prompt_tokens.inc(prompt_tokens)
        self.requests.labels(finish_reason).inc()
        self.e2e.observe(e2e)

    def render(self, running: int, waiting: int) -> bytes:
        """The exposition text, with the queue gauges set at scrape time."""
        self.running.set(running)
        self.waiting.set(waiting)
        return generate_latest(self.registry)
