"""The controller's decision: a pure function from (observation, state,
settings) to a block-size policy table and the next state.

Per batch-size bucket it maximises goodput G(B, b) = B * E[tau(b)] / t(B, b);
B is fixed inside a bucket, so E[tau(b)] / t(b) decides. E[tau(b)] = 1 +
sum_{k<b} S_k comes from the survival per draft position (``estimates``),
plus, for b > 1, the tokens n-gram lookup paths added per drafting row-round
at the nearest measured block, t(b) from the cost model (``cost``). The rules:

- b = 1 (plain decoding) is always a candidate; b never exceeds the draft's block;
- hysteresis: the table changes only for a gain above ``switch_margin``;
- a trial of a drafting block runs on until some acceptance is measured (S_1
  from ``min_verified`` drafts) and its own lookup tokens (``min_verified``
  row-rounds at that block): before that every drafting block's goodput
  rests on S = 0, and the trial block's on another block's lookup (a 26-step
  trial of b = 2 priced by b = 16's nothing sent a lone request back to plain
  decoding for a whole run, docs/LOG.md 2026-12-05 (12)). A start-up profile
  (step times, no acceptance) sends every bucket to b = 1 first, and a
  20-step trial of b = 2 that ended there, on 20 verified drafts, put it at
  0.68x of plain decoding: the lone-request bucket then decoded plainly at
  0.73x of b = 3's throughput (docs/LOG.md);
- a switch to a block the bucket has not measured live is a trial first, back
  to the best block measured there unless it holds up: an estimate is not a
  measurement, and a block chosen on one must not stay chosen while it never
  collects ``min_steps`` steps;
- exploration: a bucket with traffic re-measures a neighbouring candidate, or
  b = 1, that has no or stale data (``trials.stale_candidate``), so the
  estimates never freeze;
- a bucket without measurements takes the block of the nearest bucket that
  has them: a batch size never seen starts from the closest evidence.

The estimates change only at the start (the observation and completed paired
trials are folded in); everything after reads them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from service.controller.cost import CostModel
from service.controller.estimates import Estimates, Observation, expected_acceptance_length
from service.controller.settings import ControllerSettings
from service.controller.trials import Trial, record_paired_trials, stale_candidate, start_trial, trial_done
from service.metric_names import BUCKETS, bucket_min_batch
from speculative.policy import BlockPolicy


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
    estimates = state.estimates
    estimates.update(obs, settings.half_life_s)
    paired = record_paired_trials(estimates, state.exploring, obs, settings.min_steps)
    allowed = settings.allowed
    survival = estimates.survival_curve(max(allowed) - 1, settings.min_verified)
    reachable = estimates.survival_upper_bound(max(allowed) - 1, settings.min_verified)
    lookup = {b: estimates.lookup_tokens(b, settings.min_verified) for b in allowed}
    costs = CostModel.fit(estimates, settings)
    goodput: dict[str, dict[int, float]] = {}
    reasons: dict[str, str] = {}
    unmeasured_acceptance = estimates.measured_survival(1, settings.min_verified) is None
    for bucket in BUCKETS:
        current = min(state.table[bucket], max(allowed))
        times = costs.step_times(bucket)
        if not times:
            state.table[bucket], reasons[bucket] = current, "no measurements"
            continue
        goodput[bucket] = {b: expected_acceptance_length(survival, b, lookup[b]) / t for b, t in times.items()}
        trial = state.exploring.get(bucket)
        measuring_acceptance = (
            trial is not None
            and trial.block > 1
            and (unmeasured_acceptance or not estimates.lookup_measured(trial.block, settings.min_verified))
        )
        if trial is not None and (
            measuring_acceptance or not (bucket in paired or trial_done(estimates, bucket, trial, obs.time, settings))
        ):
            until = " until acceptance is measured" if measuring_acceptance else ""
            reasons[bucket] = f"exploring b={trial.block} in turns with b={trial.back_to}{until}"
            continue
        state.exploring.pop(bucket, None)
        back_to = trial.back_to if trial is not None else current
        state.table[bucket], reasons[bucket] = _choose(goodput[bucket], back_to, settings.switch_margin)
        if trial is not None and bucket in paired:
            reasons[bucket] += f"; paired trial: b={trial.block} step {paired[bucket]:.3f}x b={back_to}'s"
        fallback = _trial_fallback(
            state.table[bucket], back_to, costs.live[bucket], goodput[bucket], settings.switch_margin
        )
        if fallback is not None:
            state.exploring[bucket] = start_trial(estimates, bucket, state.table[bucket], fallback, obs)
            reasons[bucket] += f"; not run here yet: a trial, back to b={fallback} unless it holds up"
            continue
        best_case = {b: expected_acceptance_length(reachable, b, lookup[b]) / t for b, t in times.items()}
        explore = stale_candidate(
            estimates,
            settings,
            bucket,
            state.table[bucket],
            goodput[bucket],
            best_case,
            obs.time,
            costs.has_own_line(bucket),
        )
        if explore is not None:
            state.exploring[bucket] = start_trial(estimates, bucket, explore, state.table[bucket], obs)
            reasons[bucket] += f"; exploring b={explore}"
            state.table[bucket] = explore
    _seed_unmeasured(state, reasons, goodput)
    policy = BlockPolicy(
        tuple(bucket_min_batch(b) for b in BUCKETS),
        tuple(state.table[b] for b in BUCKETS),
        tuple(state.decided(b) for b in BUCKETS) if state.exploring else (),
    )
    return Decision(policy, dict(state.table), goodput, reasons), state


def _choose(goodput: dict[int, float], current: int, switch_margin: float) -> tuple[int, str]:
    best = max(goodput, key=goodput.__getitem__)
    if current not in goodput:
        return best, f"b={best} (current b={current} not estimable)"
    if goodput[best] > goodput[current] * (1 + switch_margin):
        return best, f"b={best}: {goodput[best] / goodput[current] - 1:+.1%} over b={current}"
    return current, f"keep b={current} (best b={best} within margin)"


def _trial_fallback(
    chosen: int, back_to: int, live: dict[int, float], goodput: dict[int, float], switch_margin: float
) -> int | None:
    """The block a switch to ``chosen`` falls back to unless ``chosen`` holds
    up live, or None when the switch needs no trial (``chosen`` is the block
    it left, or measured live here). The fallback is the best block measured
    live here: the one it left, unless another beats it by the switch margin
    (a neighbour's single trial is no reason to switch). A bucket with no live
    measurement goes to plain decoding untried (it is never far from the
    best block), but to a drafting block only as a trial against plain
    decoding, so that plain decoding keeps collecting steps to compete."""
    if chosen == back_to or chosen in live:
        return None
    if live:
        return _choose({b: goodput[b] for b in live}, back_to, switch_margin)[0]
    return 1 if chosen != 1 else None


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
