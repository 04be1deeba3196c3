"""The thin loop around ``decide``: observe -> decide -> push, every
``interval_s``. A failed observation or push changes nothing (the replicas keep
the last good policy), is counted, and the next tick tries again."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from service import metric_names as names
from service.controller.decide import ControllerState, Decision, decide
from service.controller.estimates import Observation
from service.controller.settings import ControllerSettings
from service.controller.source import SourceError
from service.metric_names import BUCKETS
from speculative.policy import BlockPolicy

log = logging.getLogger(__name__)


class ControllerMetrics:
    """The controller's own decisions and estimates, for the dashboards."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.block_size = Gauge(names.CONTROLLER_BLOCK_SIZE, "Chosen block size", ["bucket"], registry=registry)
        self.goodput = Gauge(
            names.CONTROLLER_GOODPUT,
            "Estimated committed tokens per row-second",
            ["bucket", "block_size"],
            registry=registry,
        )
        self.decisions = Counter(names.CONTROLLER_DECISIONS, "Decisions taken", registry=registry)
        self.errors = Counter(names.CONTROLLER_ERRORS, "Failed observations or pushes", ["stage"], registry=registry)
        for stage in ("observe", "push"):  # exported at 0 from the start, so rates and alerts see them
            self.errors.labels(stage)

    def export(self, decision: Decision) -> None:
        self.decisions.inc()
        for bucket in BUCKETS:
            self.block_size.labels(bucket).set(decision.table[bucket])
        for bucket, per_b in decision.goodput.items():
            for b, value in per_b.items():
                self.goodput.labels(bucket, str(b)).set(value)


class ControllerLoop:
    """Runs ``decide`` on a thread (or by ``tick`` in tests). The policy is
    pushed when it changes and, with ``repush_s``, again once the last push is
    that old (replicas that restarted or were added get it too).
    ``trial_interval_s``: while a trial is in its first ``interval_s`` or its
    bucket decoded since the previous decision, decide this often instead (a
    trial ends once its window has enough steps; waiting out a whole interval
    would run a block the controller already found worse for most of it). A
    trial whose bucket is idle is judged on the slow cadence: looking more
    often would only cost. The fast cadence also holds until the first step
    times arrive, and while a bucket without step times of its own decodes: a
    fresh server runs the draft's full block until a decision moves it, and
    with only the slow cadence that could last a whole interval.
    ``counters_from_zero``: the observed counters started with this controller
    (in-process), so the first observation holds what ran before it, the
    start-up profile, kept as the step-time shape; otherwise (a replica's
    history of unknown age) the first observation is only the baseline."""

    def __init__(
        self,
        observe: Callable[[float], Observation],
        push: Callable[[BlockPolicy], None],
        settings: ControllerSettings,
        initial_block_size: int,
        metrics: ControllerMetrics,
        *,
        interval_s: float = 10.0,
        trial_interval_s: float | None = None,
        repush_s: float | None = None,
        counters_from_zero: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.observe, self.push, self.settings, self.metrics = observe, push, settings, metrics
        self.state = ControllerState.initial(min(initial_block_size, settings.max_block_size))
        if counters_from_zero:
            self.state.estimates.baseline = Observation(clock(), {}, {}, {})
            self.state.estimates.profile_pending = True
        self.interval_s, self.repush_s, self.clock = interval_s, repush_s, clock
        self.trial_interval_s = min(interval_s, trial_interval_s or interval_s)
        self.pushed: BlockPolicy | None = None
        self._decoded: set[str] = set()  # buckets that decoded between the last two observations
        self._unmeasured: set[str] = set(BUCKETS)  # buckets the last decision had no step times for
        self._pushed_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-controller", daemon=True)

    def tick(self) -> Decision | None:
        """One observe -> decide -> push; None when the observation failed."""
        try:
            observation = self.observe(self.clock())
        except SourceError as exc:
            self.metrics.errors.labels("observe").inc()
            log.warning("controller keeps the last policy: %s", exc)
            return None
        busy = dict(self.state.estimates.busy)
        try:
            decision, self.state = decide(observation, self.state, self.settings)
        except Exception:  # a bug must not stop the thread and freeze the policy unnoticed
            self.metrics.errors.labels("decide").inc()
            log.exception("controller decision failed; keeping the last policy")
            return None
        self._decoded = {b for b, seconds in self.state.estimates.busy.items() if seconds > busy.get(b, 0.0)}
        self._unmeasured = set(BUCKETS) - decision.goodput.keys()  # goodput is estimated where step times are
        self.metrics.export(decision)
        changed = decision.policy != self.pushed
        stale = self.repush_s is not None and self.clock() - self._pushed_at >= self.repush_s
        if changed or stale:
            try:
                self.push(decision.policy)
                self.pushed, self._pushed_at = decision.policy, self.clock()
                if changed:
                    log.info("block-size policy %s (%s)", decision.table, decision.reasons)
            except Exception as exc:
                self.metrics.errors.labels("push").inc()
                log.warning("policy push failed, will retry: %s", exc)
        return decision

    def next_wait_s(self) -> float:
        """Seconds until the next decision: shorter while a trial is young or
        its bucket is decoding, before any step time is known, and while a
        bucket with none decodes."""
        now = self.clock()
        filling = any(
            now - trial.since < self.interval_s or bucket in self._decoded
            for bucket, trial in self.state.exploring.items()
        )
        measuring = self._unmeasured >= set(BUCKETS) or bool(self._unmeasured & self._decoded)
        return self.trial_interval_s if filling or measuring else self.interval_s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 5)

    def _run(self) -> None:
        # Decide at once: after a start-up profile the first requests already
        # run the profile's policy, not the draft's full block.
        self.tick()
        while not self._stop.wait(self.next_wait_s()):
            self.tick()
