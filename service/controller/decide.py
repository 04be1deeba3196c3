"""The controller's decision: a pure function from (observation, state,
settings) to a block-size policy table and the next state.

Per batch-size bucket it maximises goodput G(B, b) = B * E[tau(b)] / t(B, b)
(B is fixed inside a bucket, so E[tau(b)] / t(b) decides):

- E[tau(b)] = 1 + sum_{k<b} S_k from the survival per draft position;
- t(b): the measured mean step time of (bucket, b) where there are enough
  steps, otherwise a line t(b) = t_1 + c * (b - 1) fitted to the bucket's
  measured cells (one cell: the slope relative to t at that cell is borrowed
  from other buckets, or ``prior_slope``);
- b = 1 (plain decoding) is always a candidate; b never exceeds the draft's block;
- hysteresis: the table changes only for a gain above ``switch_margin``;
- exploration: a bucket with traffic whose neighbouring candidates have no or
  stale measurements runs one of them until it has ``min_steps`` steps, so the
  estimates never freeze.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from service.controller.estimates import Estimates, Observation, expected_acceptance_length
from speculative.policy import BlockPolicy

BUCKETS = ("1", "2-3", "4-7", "8-15", "16-31", "32-63", "64+")


def bucket_min_batch(bucket: str) -> int:
    """Smallest batch size of a bucket label ("4-7" -> 4, "64+" -> 64)."""
    return int(bucket.split("-")[0].rstrip("+"))


@dataclass(frozen=True)
class ControllerSettings:
    """Decision settings.

    candidates: block sizes the controller may choose (1 = plain decoding).
    max_block_size: the draft's trained block; larger candidates are dropped.
    half_life_s: seconds after which a measurement weighs half as much.
    min_steps: steps a (bucket, b) cell needs before its time is trusted.
    min_verified: verified drafts a position needs before its survival is trusted.
    switch_margin: relative goodput gain required to change a bucket's block size.
    explore_after_s: a neighbouring candidate measured longer ago than this is re-measured.
    prior_slope: assumed extra step time per extra block token, relative to the
        step time at the measured block size, when a bucket has one measured cell
        and no other bucket has two (0.05: a 16-token block costs 1.75x a 1-token step).
    """

    candidates: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12, 16)
    max_block_size: int = 16
    half_life_s: float = 60.0
    min_steps: float = 20.0
    min_verified: float = 50.0
    switch_margin: float = 0.05
    explore_after_s: float = 120.0
    prior_slope: float = 0.05

    def __post_init__(self) -> None:
        if 1 not in self.candidates or min(self.candidates) < 1:
            raise ValueError("candidates must include 1 (plain decoding) and be >= 1")
        if self.half_life_s <= 0 or self.min_steps <= 0 or self.switch_margin < 0:
            raise ValueError("half_life_s and min_steps must be > 0, switch_margin >= 0")

    @property
    def allowed(self) -> tuple[int, ...]:
        return tuple(sorted(b for b in set(self.candidates) if b <= self.max_block_size))


@dataclass
class ControllerState:
    """What persists between decisions."""

    table: dict[str, int]
    estimates: Estimates = field(default_factory=Estimates)
    exploring: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # bucket -> (trial b, back-to b, since)

    @classmethod
    def initial(cls, block_size: int) -> ControllerState:
        """Start with ``block_size`` at every batch size."""
        return cls(table=dict.fromkeys(BUCKETS, block_size))


@dataclass(frozen=True)
class Decision:
    """The new table, as a policy, with the estimates behind it."""

    policy: BlockPolicy
    table: dict[str, int]
    goodput: dict[str, dict[int, float]]  # bucket -> b -> estimated committed tokens per row-second
    reasons: dict[str, str]


def decide(obs: Observation, state: ControllerState, settings: ControllerSettings) -> tuple[Decision, ControllerState]:
    """Fold ``obs`` into the estimates and choose every bucket's block size."""
    state = copy.deepcopy(state)
    state.estimates.update(obs, settings.half_life_s)
    allowed = settings.allowed
    survival = state.estimates.survival_curve(max(allowed) - 1, settings.min_verified)
    slopes = _relative_slopes(state, settings)
    goodput: dict[str, dict[int, float]] = {}
    reasons: dict[str, str] = {}
    for bucket in BUCKETS:
        current = min(state.table[bucket], max(allowed))
        times = _step_times(state, settings, bucket, slopes)
        if not times:
            state.table[bucket], reasons[bucket] = current, "no measurements"
            continue
        goodput[bucket] = {b: expected_acceptance_length(survival, b) / t for b, t in times.items()}
        trial = state.exploring.get(bucket)
        if trial is not None and not _trial_done(state, settings, bucket, trial, obs.time):
            reasons[bucket] = f"exploring b={trial[0]}"
            continue
        state.exploring.pop(bucket, None)
        back_to = trial[1] if trial is not None else current
        state.table[bucket], reasons[bucket] = _choose(goodput[bucket], back_to, settings)
        neighbour = _stale_neighbour(state, settings, bucket, state.table[bucket], obs.time)
        if neighbour is not None:
            state.exploring[bucket] = (neighbour, state.table[bucket], obs.time)
            reasons[bucket] += f"; exploring b={neighbour}"
            state.table[bucket] = neighbour
    policy = BlockPolicy(tuple(bucket_min_batch(b) for b in BUCKETS), tuple(state.table[b] for b in BUCKETS))
    return Decision(policy, dict(state.table), goodput, reasons), state


def _choose(goodput: dict[int, float], current: int, settings: ControllerSettings) -> tuple[int, str]:
    best = max(goodput, key=goodput.get)
    if current not in goodput:
        return best, f"b={best} (current b={current} not estimable)"
    if goodput[best] > goodput[current] * (1 + settings.switch_margin):
        return best, f"b={best}: {goodput[best] / goodput[current] - 1:+.1%} over b={current}"
    return current, f"keep b={current} (best b={best} within margin)"


def _measured(state: ControllerState, settings: ControllerSettings, bucket: str) -> dict[int, float]:
    cells = state.estimates.step_time
    return {
        b: cells[(bucket, b)].mean
        for b in settings.allowed
        if (bucket, b) in cells and cells[(bucket, b)].samples >= settings.min_steps and cells[(bucket, b)].count > 0
    }


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares t(b) = a + c * (b - 1) over at least two points."""
    xs, ys = [b - 1 for b in points], list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    c = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - c * mean_x, c


def _relative_slopes(state: ControllerState, settings: ControllerSettings) -> list[float]:
    """c / t(1) of every bucket with at least two measured cells."""
    slopes = []
    for bucket in BUCKETS:
        points = _measured(state, settings, bucket)
        if len(points) >= 2:
            a, c = _fit(points)
            if a > 0:
                slopes.append(max(0.0, c / a))
    return slopes


def _step_times(
    state: ControllerState, settings: ControllerSettings, bucket: str, slopes: list[float]
) -> dict[int, float]:
    """Estimated step time for every allowed b (measured where trusted)."""
    points = _measured(state, settings, bucket)
    if not points:
        return {}
    if len(points) >= 2:
        a, c = _fit(points)
    else:
        ((b0, t0),) = points.items()
        relative = sorted(slopes)[len(slopes) // 2] if slopes else settings.prior_slope
        a = t0 / (1 + relative * (b0 - 1))
        c = a * relative
    floor = min(points.values()) * 0.5
    return {b: points.get(b, max(floor, a + c * (b - 1))) for b in settings.allowed}


def _trial_done(
    state: ControllerState, settings: ControllerSettings, bucket: str, trial: tuple[int, int, float], now: float
) -> bool:
    b, _, since = trial
    cell = state.estimates.step_time.get((bucket, b))
    measured = cell is not None and cell.samples >= settings.min_steps and cell.last_update >= since
    return measured or now - since > settings.explore_after_s


def _stale_neighbour(
    state: ControllerState, settings: ControllerSettings, bucket: str, chosen: int, now: float
) -> int | None:
    """An adjacent candidate with no or old data, if the bucket has live traffic."""
    cells = state.estimates.step_time
    live = cells.get((bucket, chosen))
    if live is None or now - live.last_update > settings.explore_after_s:
        return None
    allowed = settings.allowed
    i = allowed.index(chosen)
    neighbours = [allowed[j] for j in (i - 1, i + 1) if 0 <= j < len(allowed)]
    stale = [
        b
        for b in neighbours
        if (bucket, b) not in cells
        or cells[(bucket, b)].samples < settings.min_steps
        or now - cells[(bucket, b)].last_update > settings.explore_after_s
    ]
    if not stale:
        return None
    return min(stale, key=lambda b: cells[(bucket, b)].last_update if (bucket, b) in cells else float("-inf"))
