"""The controller's decision: a pure function from (observation, state,
settings) to a block-size policy table and the next state.

Per batch-size bucket it maximises goodput G(B, b) = B * E[tau(b)] / t(B, b)
(B is fixed inside a bucket, so E[tau(b)] / t(b) decides):

- E[tau(b)] = 1 + sum_{k<b} S_k from the survival per draft position;
- t(b): the measured mean step time of (bucket, b) where there are enough
  steps, carried to the present by the block that ran last (every block slows
  alike as contexts grow or the machine gets busier); otherwise, for drafting
  blocks (b >= 2), a line t(b) = a + c * (b - 1) fitted to the bucket's
  measured drafting cells (one cell: the slope relative to a is borrowed from
  other buckets, or ``prior_slope``). Plain decoding
  (b = 1) runs no draft forward, so it is off that line: unmeasured, it is
  a * the ratio t(1) / a borrowed from other buckets (or ``prior_plain_ratio``);
  a bucket with only b = 1 measured puts its line at t(1) / that ratio;
- b = 1 (plain decoding) is always a candidate; b never exceeds the draft's block;
- hysteresis: the table changes only for a gain above ``switch_margin``;
- a switch to a block the bucket has not measured live is a trial first (back
  to the best measured block unless it holds up): estimated from the profile
  or the line, blocks looked up to 18 % better than plain decoding and ran
  10-25 % worse, and stayed chosen on that estimate while trials of their
  neighbours kept them from collecting ``min_steps`` steps;
- a trial is paired: the trial block and the block it returns to take turns
  step by step (``BlockPolicy.alternates``), and once both have ``min_steps``
  steps in the trial's window the trial block's time is their ratio over that
  window times the other's mean. Timed one after the other, a cell of 20 steps
  caught whatever the shared machine did in those seconds (identical blocks
  read up to 40 % apart; a b = 2 trial read +30.9 % over plain decoding and
  the bucket left it); in turns, both see the same seconds;
- exploration: a bucket with traffic whose neighbouring candidates, or b = 1,
  have no or stale measurements (stale: not run during ``explore_after_s`` of
  the bucket's own decoding) runs one of them until it has ``min_steps``
  fresh steps, so the estimates never freeze; only candidates estimated within
  ``explore_margin`` of the chosen block are tried (re-measuring a clearly
  worse block costs more throughput than it can reveal), except that a bucket
  without its own drafting line (two measured drafting cells) always tries its
  adjacent drafting block: a borrowed slope is a guess, not evidence;
- a bucket without measurements takes the block of the nearest bucket that has
  them (batch sizes never seen start from the closest evidence, not from the
  draft's block).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from service.controller.estimates import Estimates, Observation, expected_acceptance_length
from speculative.policy import CANDIDATE_BLOCK_SIZES, BlockPolicy

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
    explore_after_s: a neighbouring candidate not run during this many seconds of
        its bucket's own decoding is re-measured (idle time does not count: traffic
        that returns after a pause runs on the last estimates instead of re-trying
        every neighbour at once).
    explore_margin: only candidates whose estimated goodput is at least (1 - this)
        times the chosen block's are explored.
    prior_slope: assumed extra step time per extra block token, relative to the
        drafting line's intercept a, when a bucket has one measured drafting cell
        and no other bucket has two (0.05: a 16-token block costs 1.75x a 2-token one).
    prior_plain_ratio: assumed plain-decoding step time t(1) relative to a, when
        no bucket has measured both (0.75: the draft forward adds a third).
    """

    candidates: tuple[int, ...] = CANDIDATE_BLOCK_SIZES
    max_block_size: int = 16
    half_life_s: float = 60.0
    min_steps: float = 20.0
    min_verified: float = 50.0
    switch_margin: float = 0.05
    explore_after_s: float = 120.0
    explore_margin: float = 0.2
    prior_slope: float = 0.05
    prior_plain_ratio: float = 0.75

    def __post_init__(self) -> None:
        if 1 not in self.candidates or min(self.candidates) < 1:
            raise ValueError("candidates must include 1 (plain decoding) and be >= 1")
        if self.half_life_s <= 0 or self.min_steps <= 0 or self.switch_margin < 0:
            raise ValueError("half_life_s and min_steps must be > 0, switch_margin >= 0")
        if self.prior_slope < 0 or self.prior_plain_ratio <= 0 or not 0 <= self.explore_margin <= 1:
            raise ValueError("prior_slope must be >= 0, prior_plain_ratio > 0, explore_margin in [0, 1]")

    @property
    def allowed(self) -> tuple[int, ...]:
        return tuple(sorted(b for b in set(self.candidates) if b <= self.max_block_size))


@dataclass(frozen=True)
class Trial:
    """A bucket running ``block`` in turns with ``back_to`` to measure it, then
    deciding again from ``back_to``. Done once both blocks have ``min_steps``
    steps since it began (``counters_at_start``: their cumulative (seconds,
    steps) then; a paired result), else, unpaired, once the cell is trusted
    (``min_steps`` steps) and, if it was trusted when the trial began
    (``samples_at_start``), has ``min_steps`` fresh ones: a re-measurement
    needs new evidence, not one step; steps of earlier unfinished trials still
    count (a bucket with sparse traffic never collected enough steps in one
    trial)."""

    block: int
    back_to: int
    since: float
    samples_at_start: float
    counters_at_start: tuple[tuple[float, float], tuple[float, float]]
    restarts_at_start: int


@dataclass
class ControllerState:
    """What persists between decisions."""

    table: dict[str, int]
    estimates: Estimates = field(default_factory=Estimates)
    exploring: dict[str, Trial] = field(default_factory=dict)  # bucket -> its running trial

    @classmethod
    def initial(cls, block_size: int) -> ControllerState:
        """Start with ``block_size`` at every batch size."""
        return cls(table=dict.fromkeys(BUCKETS, block_size))

    def decided(self, bucket: str) -> int:
        """The bucket's chosen block: the one a running trial returns to."""
        trial = self.exploring.get(bucket)
        return trial.back_to if trial is not None else self.table[bucket]


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
    paired = _record_paired_trials(state, settings, obs)
    allowed = settings.allowed
    survival = state.estimates.survival_curve(max(allowed) - 1, settings.min_verified)
    reachable = state.estimates.survival_upper_bound(max(allowed) - 1, settings.min_verified)
    # The estimates are fixed for the rest of the decision: every bucket's
    # measured cells once (recomputed per use, they were half of decide's time).
    live = {bucket: _live(state, settings, bucket) for bucket in BUCKETS}
    measured = {bucket: _measured(state, settings, bucket, live) for bucket in BUCKETS}
    shape = _cost_shape(measured, settings)
    goodput: dict[str, dict[int, float]] = {}
    reasons: dict[str, str] = {}
    for bucket in BUCKETS:
        current = min(state.table[bucket], max(allowed))
        times = _step_times(settings, measured[bucket], shape)
        if not times:
            state.table[bucket], reasons[bucket] = current, "no measurements"
            continue
        goodput[bucket] = {b: expected_acceptance_length(survival, b) / t for b, t in times.items()}
        trial = state.exploring.get(bucket)
        if trial is not None and bucket not in paired and not _trial_done(state, settings, bucket, trial, obs.time):
            reasons[bucket] = f"exploring b={trial.block} in turns with b={trial.back_to}"
            continue
        state.exploring.pop(bucket, None)
        back_to = trial.back_to if trial is not None else current
        state.table[bucket], reasons[bucket] = _choose(goodput[bucket], back_to, settings)
        if bucket in paired:
            reasons[bucket] += f"; paired trial: b={trial.block} step {paired[bucket]:.3f}x b={back_to}'s"
        anchor = _trial_anchor(state.table[bucket], back_to, live[bucket], goodput[bucket], settings)
        if anchor is not None:
            state.exploring[bucket] = _start_trial(state, bucket, state.table[bucket], anchor, obs)
            reasons[bucket] += f"; not run here yet: a trial, back to b={anchor} unless it holds up"
            continue
        best_case = {b: expected_acceptance_length(reachable, b) / t for b, t in times.items()}
        own_line = sum(b > 1 for b in measured[bucket]) >= 2
        trial_b = _stale_candidate(state, settings, bucket, goodput[bucket], best_case, obs.time, own_line)
        if trial_b is not None:
            state.exploring[bucket] = _start_trial(state, bucket, trial_b, state.table[bucket], obs)
            reasons[bucket] += f"; exploring b={trial_b}"
            state.table[bucket] = trial_b
    _seed_unmeasured(state, reasons, goodput)
    policy = BlockPolicy(
        tuple(bucket_min_batch(b) for b in BUCKETS),
        tuple(state.table[b] for b in BUCKETS),
        tuple(state.decided(b) for b in BUCKETS) if state.exploring else (),
    )
    return Decision(policy, dict(state.table), goodput, reasons), state


def _choose(goodput: dict[int, float], current: int, settings: ControllerSettings) -> tuple[int, str]:
    best = max(goodput, key=goodput.get)
    if current not in goodput:
        return best, f"b={best} (current b={current} not estimable)"
    if goodput[best] > goodput[current] * (1 + settings.switch_margin):
        return best, f"b={best}: {goodput[best] / goodput[current] - 1:+.1%} over b={current}"
    return current, f"keep b={current} (best b={best} within margin)"


def _trial_anchor(
    chosen: int, back_to: int, live: dict[int, float], goodput: dict[int, float], settings: ControllerSettings
) -> int | None:
    """The block a switch to ``chosen`` returns to unless it holds up live, or
    None when the switch needs no trial. An estimate is not a measurement: a
    block the bucket has not measured live runs as a trial, back to the best
    block measured here (the block it left, unless another measured one beats
    it by the switch margin: a neighbour's one trial is not a reason to
    switch). A bucket with no live measurement at all goes to plain decoding
    untried (it is never far from the best block), but to a drafting block
    only as a trial against plain decoding: batch 4-7, before any traffic
    there, left b = 1 for b = 2 on the start-up profile and acceptance seen at
    batch 1, and ran drafting blocks at 0.84x plain decoding's throughput for
    most of a sweep, b = 1 never collecting enough steps there to compete."""
    if chosen == back_to or chosen in live:
        return None
    if live:
        return _choose({b: goodput[b] for b in live}, back_to, settings)[0]
    return 1 if chosen != 1 else None


def _live(state: ControllerState, settings: ControllerSettings, bucket: str) -> dict[int, float]:
    """Mean step time of the bucket's cells with enough live steps, carried to
    the present by the block that ran last (``Estimates.comparable_means``; a
    mean that is not positive is a torn read of the counters, not a
    measurement; a cell whose decayed count is 0 has a NaN mean, which fails
    the same test)."""
    cells = state.estimates.step_time
    trusted = [
        b
        for b in settings.allowed
        if (bucket, b) in cells and cells[(bucket, b)].samples >= settings.min_steps and cells[(bucket, b)].mean > 0
    ]
    return state.estimates.comparable_means(bucket, trusted, settings.min_steps)


def _profile_level(state: ControllerState, bucket: str, plain: bool, live: dict[str, dict[int, float]]) -> float:
    """Live over profiled step time for plain decoding (``plain``) or for drafting
    blocks: the median ratio over the bucket's cells of that kind measured both
    ways, else over every bucket's cells of that kind, else over any cells of the
    bucket, then of every bucket, else 1. The kinds scale apart because serving
    slows drafting steps more than plain ones (bundled pair, two requests: live
    b = 1 ran 1.2x its profiled time, b = 8 and 16 1.5x; one shared ratio made
    b = 8 look 14 % better than plain decoding, and it measured 20 % worse)."""
    profile = state.estimates.profile

    def ratios(buckets: tuple[str, ...], kind: bool | None) -> list[float]:  # kind None: either
        return [
            t / profile[(k, b)]
            for k in buckets
            for b, t in live[k].items()
            if (k, b) in profile and kind in (None, b == 1)
        ]

    for buckets, kind in (((bucket,), plain), (BUCKETS, plain), ((bucket,), None), (BUCKETS, None)):
        if found := ratios(buckets, kind):
            return _median(found, 1.0)
    return 1.0


def _measured(
    state: ControllerState, settings: ControllerSettings, bucket: str, live: dict[str, dict[int, float]]
) -> dict[int, float]:
    """Step times of the bucket's measured cells: live where trusted, else the
    start-up profile scaled to the live level of its kind (serving adds CPU
    contention the profile did not see: on 2 cores live steps ran up to 3x the
    profiled time, and an unscaled profiled block looked better than a
    live-measured one)."""
    profile = state.estimates.profile
    profiled = {b: profile[(bucket, b)] for b in settings.allowed if (bucket, b) in profile}
    if not profiled:
        return live[bucket]
    levels = {plain: _profile_level(state, bucket, plain, live) for plain in (True, False)}
    return {**{b: t * levels[b == 1] for b, t in profiled.items()}, **live[bucket]}


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares t(b) = a + c * (b - 1) over at least two points."""
    xs, ys = [b - 1 for b in points], list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    c = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - c * mean_x, c


@dataclass(frozen=True)
class _CostShape:
    """How step time grows with b, shared by buckets that lack the data: the
    drafting line's slope c / a and plain decoding's t(1) / a."""

    slope: float
    plain_ratio: float


def _median(values: list[float], default: float) -> float:
    return sorted(values)[len(values) // 2] if values else default


def _cost_shape(measured: dict[str, dict[int, float]], settings: ControllerSettings) -> _CostShape:
    """Medians over buckets with at least two measured drafting cells (else the priors)."""
    slopes, ratios = [], []
    for points in measured.values():
        drafting = {b: t for b, t in points.items() if b > 1}
        if len(drafting) >= 2:
            a, c = _fit(drafting)
            if a > 0:
                slopes.append(max(0.0, c / a))
                if 1 in points:
                    ratios.append(points[1] / a)
    return _CostShape(_median(slopes, settings.prior_slope), _median(ratios, settings.prior_plain_ratio))


def _step_times(settings: ControllerSettings, points: dict[int, float], shape: _CostShape) -> dict[int, float]:
    """Estimated step time for every allowed b, from the bucket's measured
    ``points`` (kept where measured)."""
    if not points:
        return {}
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
    times = {b: max(floor, a + c * (b - 1)) for b in settings.allowed}
    times[1] = max(floor, a * shape.plain_ratio)
    return {**times, **points}


def _start_trial(state: ControllerState, bucket: str, block: int, back_to: int, obs: Observation) -> Trial:
    cell = state.estimates.step_time.get((bucket, block))
    counters = tuple(obs.step_seconds.get((bucket, b), (0.0, 0.0)) for b in (block, back_to))
    samples = cell.samples if cell is not None else 0.0
    return Trial(block, back_to, obs.time, samples, counters, state.estimates.restarts)


def _paired_window(
    state: ControllerState, settings: ControllerSettings, bucket: str, trial: Trial, obs: Observation
) -> tuple[float, float] | None:
    """(mean step time of the trial block over that of the block it took turns
    with, the trial block's steps) over the trial's window, once both ran
    ``min_steps`` steps in it (None before, or if counters restarted since)."""
    if state.estimates.restarts != trial.restarts_at_start:
        return None
    now = [obs.step_seconds.get((bucket, b), (0.0, 0.0)) for b in (trial.block, trial.back_to)]
    (trial_s, trial_n), (other_s, other_n) = [
        (seconds - seconds_then, steps - steps_then)
        for (seconds, steps), (seconds_then, steps_then) in zip(now, trial.counters_at_start, strict=True)
    ]
    if min(trial_n, other_n) < settings.min_steps or min(trial_s, other_s) <= 0:
        return None
    return (trial_s / trial_n) / (other_s / other_n), trial_n


def _record_paired_trials(state: ControllerState, settings: ControllerSettings, obs: Observation) -> dict[str, float]:
    """Record each trial whose paired window is complete in the estimates;
    bucket -> ratio of those."""
    done = {}
    for bucket, trial in state.exploring.items():
        window = _paired_window(state, settings, bucket, trial, obs)
        if window is not None:
            state.estimates.record_pair((bucket, trial.block), trial.back_to, *window)
            done[bucket] = window[0]
    return done


def _trial_done(state: ControllerState, settings: ControllerSettings, bucket: str, trial: Trial, now: float) -> bool:
    cell = state.estimates.step_time.get((bucket, trial.block))
    needed = settings.min_steps + (trial.samples_at_start if trial.samples_at_start >= settings.min_steps else 0.0)
    return (cell is not None and cell.samples >= needed) or now - trial.since > settings.explore_after_s


def _stale_candidate(
    state: ControllerState,
    settings: ControllerSettings,
    bucket: str,
    goodput: dict[int, float],
    best_case: dict[int, float],
    now: float,
    own_line: bool,
) -> int | None:
    """An adjacent candidate, or b = 1, with no or old data whose best-case
    goodput (unmeasured draft positions as good as the last measured one) is
    within ``explore_margin`` of the chosen block's estimate, if the bucket has
    live traffic. Until the bucket has two measured drafting cells
    (``own_line``) its step times come from a borrowed slope (a guess: a
    crowded bucket is steeper than the idle one it borrows from), so an
    adjacent drafting block is tried whatever that guess says."""
    chosen = state.table[bucket]
    cells = state.estimates.step_time
    live = cells.get((bucket, chosen))
    if live is None or now - live.last_update > settings.explore_after_s:
        return None
    allowed = settings.allowed
    i = allowed.index(chosen)
    neighbours = {allowed[j] for j in (i - 1, i + 1) if 0 <= j < len(allowed)}
    slope_probes = set() if own_line else {b for b in neighbours if b > 1}
    stale = [
        b
        for b in sorted((neighbours | {1}) - {chosen})
        if (b in slope_probes or best_case[b] >= (1 - settings.explore_margin) * goodput[chosen])
        and (
            (bucket, b) not in cells
            or cells[(bucket, b)].samples < settings.min_steps
            or state.estimates.busy_since((bucket, b)) > settings.explore_after_s
        )
    ]
    if not stale:
        return None
    return min(stale, key=lambda b: cells[(bucket, b)].last_update if (bucket, b) in cells else float("-inf"))


def _seed_unmeasured(state: ControllerState, reasons: dict[str, str], goodput: dict[str, dict[int, float]]) -> None:
    """Buckets without measurements take the block of the nearest measured bucket
    (ties: the smaller batch size; a bucket mid-trial lends the block it returns to)."""
    measured = [i for i, bucket in enumerate(BUCKETS) if bucket in goodput]
    if not measured:
        return
    for i, bucket in enumerate(BUCKETS):
        if bucket not in goodput:
            source = BUCKETS[min(measured, key=lambda j: (abs(j - i), j))]
            state.table[bucket] = state.decided(source)
            reasons[bucket] = f"no measurements: b={state.table[bucket]} from bucket {source}"
