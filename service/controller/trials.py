"""Trials: a bucket runs a block to measure it, in turns with the block it
returns to, and decides again once the trial has the steps it needs.

A trial is paired: the two blocks take turns step by step
(``BlockPolicy.alternates``), so both see the same seconds of a shared,
drifting machine; once both have ``min_steps`` steps in the trial's window
the trial block's time is their ratio over that window times the other's
mean. A trial whose window does not fill (sparse traffic) ends unpaired, once
the trial block's own cell is trusted, or after ``explore_after_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.controller.estimates import Estimates, Observation
from service.controller.settings import ControllerSettings


@dataclass(frozen=True)
class Trial:
    """A bucket running ``block`` in turns with ``back_to`` since ``since``.
    ``counters_at_start``: the two blocks' cumulative (seconds, steps) then,
    the start of the paired window; ``samples_at_start``: the trial block's
    samples then (a cell already trusted needs ``min_steps`` fresh ones to end
    unpaired: a re-measurement needs new evidence, while steps of earlier
    unfinished trials of a never-trusted cell still count);
    ``restarts_at_start``: counter resets seen then (a reset voids the window)."""

    block: int
    back_to: int
    since: float
    samples_at_start: float
    counters_at_start: tuple[tuple[float, float], tuple[float, float]]
    restarts_at_start: int


def start_trial(estimates: Estimates, bucket: str, block: int, back_to: int, obs: Observation) -> Trial:
    """A trial of ``block`` in ``bucket``, returning to ``back_to``, from ``obs`` on."""
    cell = estimates.step_time.get((bucket, block))
    counters = (
        obs.step_seconds.get((bucket, block), (0.0, 0.0)),
        obs.step_seconds.get((bucket, back_to), (0.0, 0.0)),
    )
    samples = cell.samples if cell is not None else 0.0
    return Trial(block, back_to, obs.time, samples, counters, estimates.restarts)


def record_paired_trials(
    estimates: Estimates, exploring: dict[str, Trial], obs: Observation, min_steps: float
) -> dict[str, float]:
    """Record each trial whose paired window is complete in ``estimates``;
    bucket -> the trial block's step time over its partner's in that window."""
    done = {}
    for bucket, trial in exploring.items():
        window = _paired_window(estimates, bucket, trial, obs, min_steps)
        if window is not None:
            estimates.record_pair((bucket, trial.block), trial.back_to, *window)
            done[bucket] = window[0]
    return done


def _paired_window(
    estimates: Estimates, bucket: str, trial: Trial, obs: Observation, min_steps: float
) -> tuple[float, float] | None:
    """(mean step time of the trial block over that of the block it took turns
    with, the trial block's steps) over the trial's window, once both ran
    ``min_steps`` steps in it (None before, or if counters restarted since)."""
    if estimates.restarts != trial.restarts_at_start:
        return None
    now = [obs.step_seconds.get((bucket, b), (0.0, 0.0)) for b in (trial.block, trial.back_to)]
    (trial_s, trial_n), (other_s, other_n) = [
        (seconds - seconds_then, steps - steps_then)
        for (seconds, steps), (seconds_then, steps_then) in zip(now, trial.counters_at_start, strict=True)
    ]
    if min(trial_n, other_n) < min_steps or min(trial_s, other_s) <= 0:
        return None
    return (trial_s / trial_n) / (other_s / other_n), trial_n


def trial_done(estimates: Estimates, bucket: str, trial: Trial, now: float, settings: ControllerSettings) -> bool:
    """Whether an unpaired trial has ended: its cell has ``min_steps`` steps
    (fresh ones if it was trusted when the trial began), or it ran
    ``explore_after_s``."""
    cell = estimates.step_time.get((bucket, trial.block))
    needed = settings.min_steps + (trial.samples_at_start if trial.samples_at_start >= settings.min_steps else 0.0)
    return (cell is not None and cell.samples >= needed) or now - trial.since > settings.explore_after_s


def stale_candidate(
    estimates: Estimates,
    settings: ControllerSettings,
    bucket: str,
    chosen: int,
    goodput: dict[int, float],
    best_case: dict[int, float],
    now: float,
    own_line: bool,
) -> int | None:
    """The block to explore next to ``chosen``, if the bucket has live traffic:
    an adjacent candidate, or b = 1, with no or stale data (not run during
    ``explore_after_s`` of the bucket's own decoding), the least recently run
    first. Only blocks whose best-case goodput is within ``explore_margin`` of
    the chosen block's qualify (re-measuring a clearly worse block costs more
    than it can reveal), except that without its own drafting line
    (``own_line``) the bucket's step times rest on a borrowed slope, a guess,
    so an adjacent drafting block is tried whatever it says."""
    cells = estimates.step_time
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
            or estimates.busy_since((bucket, b)) > settings.explore_after_s
        )
    ]
    if not stale:
        return None
    return min(stale, key=lambda b: cells[(bucket, b)].last_update if (bucket, b) in cells else float("-inf"))
