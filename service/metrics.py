"""Every Prometheus object of the service, fed from engine ``RoundStats`` and
request timings. Only raw counters, histograms and gauges are exported; rates
and ratios are derived in PromQL (the dashboards use exactly these):

Mean acceptance length (tokens committed per verify round and request; add
``by (block_size)`` to every sum for one curve per block size):
    (sum(rate(dflash_accepted_tokens_total[1m])) + sum(rate(dflash_verify_rows_total[1m])))
      / sum(rate(dflash_verify_rows_total[1m]))
Survival / acceptance at draft position k (correct when b changes, because
only rows that verified a draft at position k count in the denominator):
    rate(dflash_accepted_tokens_per_position_total{position="k"}[5m])
      / rate(dflash_verified_tokens_per_position_total{position="k"}[5m])
Draft acceptance rate:
    sum(rate(dflash_accepted_tokens_total[5m])) / sum(rate(dflash_draft_tokens_total[5m]))
Estimated speedup over plain decoding (tokens per second of a step versus a
b=1 step at the same batch bucket), e.g. for bucket "1":
    (sum(rate(dflash_generation_tokens_total[5m]))
      / sum(rate(dflash_step_seconds_sum[5m])))
    / (sum(rate(dflash_step_seconds_count{block_size="1",batch_bucket="1"}[5m]))
      / sum(rate(dflash_step_seconds_sum{block_size="1",batch_bucket="1"}[5m])))
Refused requests per second by reason (queue_full = 429, draining = 503,
invalid = 400, ...):
    sum by (reason) (rate(dflash_refused_requests_total[1m]))
Step time by block size and batch bucket (the controller's cost model):
    rate(dflash_step_seconds_sum[5m]) / rate(dflash_step_seconds_count[5m])
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from speculative.session import RoundStats

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def batch_bucket(batch_size: int) -> str:
    """Power-of-two batch-size bucket label: "1", "2-3", "4-7", ..., "64+"."""
    if batch_size >= 64:
        return "64+"
    low = 1 << (batch_size.bit_length() - 1)
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


class Metrics:
    """The service's metrics on their own registry (one per app)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.verify_steps = Counter(
            "dflash_verify_steps", "Engine steps (one draft + one target forward)", ["block_size"], registry=r
        )
        self.verify_rows = Counter(
            "dflash_verify_rows", "Row-rounds verified (requests x steps)", ["block_size"], registry=r
        )
        self.draft_tokens = Counter("dflash_draft_tokens", "Drafted tokens verified", ["block_size"], registry=r)
        self.accepted_tokens = Counter("dflash_accepted_tokens", "Drafted tokens accepted", ["block_size"], registry=r)
        self.accepted_per_position = Counter(
            "dflash_accepted_tokens_per_position", "Drafts accepted at block position", ["position"], registry=r
        )
        self.verified_per_position = Counter(
            "dflash_verified_tokens_per_position", "Drafts verified at block position", ["position"], registry=r
        )
        self.step_seconds = Histogram(
            "dflash_step_seconds", "Engine step time", ["block_size", "batch_bucket"], buckets=STEP_BUCKETS, registry=r
        )
        self.block_size = Gauge("dflash_block_size", "Block size of the latest step", registry=r)
        self.running = Gauge("dflash_running_requests", "Requests being decoded", registry=r)
        self.waiting = Gauge("dflash_waiting_requests", "Requests waiting for a slot", registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Generated tokens (as produced)", registry=r)
        self.requests = Counter("dflash_requests", "Finished requests", ["finish_reason"], registry=r)
        self.refused = Counter(
            "dflash_refused_requests", "Requests refused before decoding, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "dflash_inter_token_latency_seconds",
            "Time between a request's output deltas",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dflash_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )

    def controller_inputs(self) -> tuple[Histogram, Counter, Counter]:
        """The metrics the block-size controller reads (step time per cell,
        acceptance per position)."""
        return self.step_seconds, self.accepted_per_position, self.verified_per_position

    def observe_step(self, stats: RoundStats, seconds: float) -> None:
        """Account one engine step (called on the scheduler thread)."""
        self.observe_steps(stats, seconds, 1)

    def observe_steps(self, stats: RoundStats, seconds: float, steps: int) -> None:
        """Account ``steps`` steps of one batch size and block size, summed in
        ``stats`` (per-position counts) and ``seconds`` (engines that report
        aggregates, e.g. SGLang's schedulers; each step is observed at the mean
        time, so the histogram's sum and count are exact)."""
        b = str(stats.block_size)
        self.verify_steps.labels(b).inc(steps)
        self.verify_rows.labels(b).inc(stats.batch_size * steps)
        for _ in range(steps):
            self.observe_step_time(stats, seconds / steps)
        self.block_size.set(stats.block_size)
        if stats.block_size > 1:
            self.draft_tokens.labels(b).inc(sum(stats.verified_per_position))
            self.accepted_tokens.labels(b).inc(sum(stats.accepted_per_position))
            for k, (accepted, verified) in enumerate(
                zip(stats.accepted_per_position, stats.verified_per_position, strict=True), start=1
            ):
                self.accepted_per_position.labels(str(k)).inc(accepted)
                self.verified_per_position.labels(str(k)).inc(verified)

    def observe_step_time(self, stats: RoundStats, seconds: float) -> None:
        """Account a step's time only (start-up profile: its acceptance is not real)."""
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
