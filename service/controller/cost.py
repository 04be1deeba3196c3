"""The controller's cost model: the step time t(b) of every allowed block size
in every batch bucket, fitted once per decision from the estimates.

- A measured cell keeps its time: the live mean where it has ``min_steps``
  steps, carried to the present (``Estimates.comparable_means``), else the
  start-up profile scaled to the live level of its kind (plain or drafting).
- Unmeasured drafting blocks (b >= 2) lie on a line t(b) = a + c * (b - 1)
  fitted to the bucket's measured drafting cells; with one such cell, the
  slope c / a comes from the nearest buckets that have one, or ``prior_slope``.
- Plain decoding (b = 1) runs no draft forward, so it is off that line:
  unmeasured, it is a * t(1) / a borrowed from the nearest buckets that have
  it, or ``prior_plain_ratio``; a bucket with only b = 1 measured puts its
  line at t(1) / that ratio.

Borrowed from the nearest buckets, not a median over all: both numbers move
with the batch. A drafting step verifies the block and the tree's alternates
and lookup tokens for every row, so as the batch grows verification turns
compute-bound and drafting costs ever more beside a plain step (served, the
default pair's b = 1 step was 0.44x a b = 3 step at 4-7 rows). The median
over buckets 1 and 4-7 gave a new 8-15 bucket the lone row's ratio: it kept
drafting at 0.68x of plain decoding's throughput (docs/LOG.md, 2026-12-04 (8)).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.controller.estimates import Cell, Estimates
from service.controller.settings import ControllerSettings
from service.metric_names import BUCKETS

Times = dict[int, float]  # block size -> seconds per step


@dataclass(frozen=True)
class CostShape:
    """How step time grows with b, for buckets that lack the data: the drafting
    line's slope c / a and plain decoding's t(1) / a."""

    slope: float
    plain_ratio: float


@dataclass(frozen=True)
class CostModel:
    """Step times per bucket: ``live`` (trusted live cells), ``measured`` (live
    and scaled profile cells) and each bucket's borrowed ``shapes`` for what it lacks."""

    allowed: tuple[int, ...]
    live: dict[str, Times]
    measured: dict[str, Times]
    shapes: dict[str, CostShape]

    @classmethod
    def fit(cls, estimates: Estimates, settings: ControllerSettings) -> CostModel:
        """The cost model of every bucket from the estimates as they are now."""
        allowed = settings.allowed
        live = {bucket: live_step_times(estimates, bucket, allowed, settings.min_steps) for bucket in BUCKETS}
        measured = {bucket: _with_profile(estimates.profile, bucket, allowed, live) for bucket in BUCKETS}
        shapes = _borrowed_shapes(measured, settings.prior_slope, settings.prior_plain_ratio)
        return cls(allowed, live, measured, shapes)

    def step_times(self, bucket: str) -> Times:
        """Estimated step time of every allowed b in ``bucket`` (empty without
        a measured cell there)."""
        points = self.measured[bucket]
        if not points:
            return {}
        shape = self.shapes[bucket]
        drafting = {b: t for b, t in points.items() if b > 1}
        if len(drafting) >= 2:
            a, c = _fit(drafting)
        elif drafting:
            ((b0, t0),) = drafting.items()
            a = t0 / (1 + shape.slope * (b0 - 1))
            c = a * shape.slope
        else:
            a = points[1] / shape.plain_ratio
            c = a * shape.slope
        floor = min(points.values()) * 0.5
        times = {b: max(floor, a + c * (b - 1)) for b in self.allowed}
        times[1] = max(floor, a * shape.plain_ratio)
        return {**times, **points}

    def has_own_line(self, bucket: str) -> bool:
        """Whether the bucket's drafting line rests on two of its own cells (not a borrowed slope)."""
        return sum(b > 1 for b in self.measured[bucket]) >= 2


def live_step_times(estimates: Estimates, bucket: str, allowed: tuple[int, ...], min_steps: float) -> Times:
    """Mean step time of the bucket's cells with ``min_steps`` live steps,
    carried to the present. A mean that is not positive is a torn read of the
    counters, not a measurement (a cell whose decayed count is 0 has a NaN
    mean, which fails the same test)."""
    cells = estimates.step_time
    trusted = [
        b
        for b in allowed
        if (bucket, b) in cells and cells[(bucket, b)].samples >= min_steps and cells[(bucket, b)].mean > 0
    ]
    return estimates.comparable_means(bucket, trusted, min_steps)


def _with_profile(profile: dict[Cell, float], bucket: str, allowed: tuple[int, ...], live: dict[str, Times]) -> Times:
    """The bucket's live cells and, where none is live, its profiled cells at
    the live level of their kind: the profile ran without serving's CPU
    contention, so it gives the shape of t(b), not its level."""
    profiled = {b: profile[(bucket, b)] for b in allowed if (bucket, b) in profile}
    if not profiled:
        return live[bucket]
    levels = {plain: _profile_level(profile, bucket, plain, live) for plain in (True, False)}
    return {**{b: t * levels[b == 1] for b, t in profiled.items()}, **live[bucket]}


def _profile_level(profile: dict[Cell, float], bucket: str, plain: bool, live: dict[str, Times]) -> float:
    """Live over profiled step time for plain decoding (``plain``) or for
    drafting blocks: the median ratio over the bucket's cells of that kind
    measured both ways, else over every bucket's cells of that kind, else over
    any cells of the bucket, then of every bucket, else 1. The kinds get their
    own level because serving slows drafting steps more than plain ones."""

    def ratios(buckets: tuple[str, ...], kind: bool | None) -> list[float]:  # kind None: either
        return [
            t / profile[(k, b)]
            for k in buckets
            for b, t in live[k].items()
            if (k, b) in profile and kind in (None, b == 1)
        ]

    every = tuple(live)
    for buckets, kind in (((bucket,), plain), (every, plain), ((bucket,), None), (every, None)):
        if found := ratios(buckets, kind):
            return _median(found, 1.0)
    return 1.0


def _borrowed_shapes(measured: dict[str, Times], prior_slope: float, prior_plain_ratio: float) -> dict[str, CostShape]:
    """Per bucket, the slope c / a of the nearest buckets (in bucket order; two
    at equal distance: their mean) with at least two measured drafting cells,
    and t(1) / a of the nearest with plain decoding measured too; the priors
    where no bucket has them. A bucket with its own line or t(1) is nearest
    to itself."""
    slopes: dict[int, float] = {}
    ratios: dict[int, float] = {}
    for i, bucket in enumerate(BUCKETS):
        drafting = {b: t for b, t in measured[bucket].items() if b > 1}
        if len(drafting) >= 2:
            a, c = _fit(drafting)
            if a > 0:
                slopes[i] = max(0.0, c / a)
                if 1 in measured[bucket]:
                    ratios[i] = measured[bucket][1] / a
    return {
        bucket: CostShape(_nearest(slopes, i, prior_slope), _nearest(ratios, i, prior_plain_ratio))
        for i, bucket in enumerate(BUCKETS)
    }


def _nearest(values: dict[int, float], i: int, default: float) -> float:
    """The mean of ``values`` at the bucket indices nearest ``i`` (``default`` without any)."""
    if not values:
        return default
    distance = min(abs(j - i) for j in values)
    near = [v for j, v in values.items() if abs(j - i) == distance]
    return sum(near) / len(near)


def _fit(points: Times) -> tuple[float, float]:
    """Least-squares t(b) = a + c * (b - 1) over at least two points."""
    xs, ys = [b - 1 for b in points], list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    c = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - c * mean_x, c


def _median(values: list[float], default: float) -> float:
    return sorted(values)[len(values) // 2] if values else default
