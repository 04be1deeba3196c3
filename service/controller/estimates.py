"""What the controller knows: step time per (batch bucket, block size) and
draft survival per position, as exponentially decayed sums of the deltas of
cumulative Prometheus counters (so old load stops counting, but nothing is
forgotten abruptly).

Observation = one scrape of the raw counters (``service.metrics``):
  step_seconds[(bucket, b)] = (sum of step seconds, step count)   # histogram _sum/_count
  accepted[k], verified[k]  = drafts accepted / verified at block position k
  lookup_accepted[b], drafting_rows[b] = tokens n-gram lookup paths committed
                              beyond the draft's / row-rounds verified, at block b > 1
Counters only grow; a decrease means the replica restarted, and that scrape is
taken as the new baseline.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

Cell = tuple[str, int]  # (batch bucket label, block size)


@dataclass(frozen=True)
class Observation:
    """One scrape of cumulative counters, taken at ``time`` (seconds)."""

    time: float
    step_seconds: dict[Cell, tuple[float, float]]
    accepted: dict[int, float]
    verified: dict[int, float]
    lookup_accepted: dict[int, float] = field(default_factory=dict)
    drafting_rows: dict[int, float] = field(default_factory=dict)


@dataclass
class Decayed:
    """An exponentially decayed sum and count."""

    total: float = 0.0
    count: float = 0.0
    samples: float = 0.0  # undecayed: how much evidence the mean was ever built from
    last_update: float = float("-inf")

    def add(self, total: float, count: float, now: float, decay: float) -> None:
        self.total = self.total * decay + total
        self.count = self.count * decay + count
        self.samples += count
        if count > 0:
            self.last_update = now

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else float("nan")


@dataclass
class Estimates:
    """Decayed step times per cell and acceptance per draft position."""

    step_time: dict[Cell, Decayed] = field(default_factory=dict)
    survival: dict[int, Decayed] = field(default_factory=dict)
    lookup: dict[int, Decayed] = field(default_factory=dict)  # block -> lookup tokens per drafting row-round
    baseline: Observation | None = None
    profile: dict[Cell, float] = field(default_factory=dict)  # start-up profile: mean step time per cell
    profile_pending: bool = False  # the next observation's step times are the start-up profile
    busy: dict[str, float] = field(default_factory=dict)  # bucket -> step seconds ever served
    busy_at_update: dict[Cell, float] = field(default_factory=dict)  # the bucket's busy seconds when the cell last ran
    # The bucket's other cells when the cell last ran: block -> (mean, decayed step count).
    peers_at_update: dict[Cell, dict[int, tuple[float, float]]] = field(default_factory=dict)
    restarts: int = 0  # counter resets seen (a replica restarted)

    def update(self, obs: Observation, half_life_s: float) -> None:
        """Fold the counter deltas since the previous observation in."""
        previous, self.baseline = self.baseline, obs
        restarted = previous is not None and _restarted(previous, obs)
        self.restarts += restarted
        if previous is None or restarted:
            return
        decay = 0.5 ** (max(0.0, obs.time - previous.time) / half_life_s)
        deltas = {}
        for cell in set(self.step_time) | set(obs.step_seconds):
            now_sum, now_count = obs.step_seconds.get(cell, (0.0, 0.0))
            old_sum, old_count = previous.step_seconds.get(cell, (0.0, 0.0))
            deltas[cell] = (now_sum - old_sum, now_count - old_count)
        if self.profile_pending:
            # Timed before serving, without the HTTP side competing for the CPU: its
            # cells give the shape of t(b), not the level live steps run at.
            self.profile_pending = False
            self.profile.update({cell: seconds / steps for cell, (seconds, steps) in deltas.items() if steps > 0})
            return
        for (bucket, _), (seconds, _) in deltas.items():
            self.busy[bucket] = self.busy.get(bucket, 0.0) + max(0.0, seconds)
        for cell, (seconds, steps) in deltas.items():
            self.step_time.setdefault(cell, Decayed()).add(seconds, steps, obs.time, decay)
        for cell in [cell for cell, (_, steps) in deltas.items() if steps > 0]:
            self.busy_at_update[cell] = self.busy[cell[0]]
            self.peers_at_update[cell] = {
                b: (d.mean, d.count)
                for (bucket, b), d in self.step_time.items()
                if bucket == cell[0] and b != cell[1] and d.count > 0
            }
        for k in set(self.survival) | set(obs.verified):
            verified = obs.verified.get(k, 0.0) - previous.verified.get(k, 0.0)
            accepted = obs.accepted.get(k, 0.0) - previous.accepted.get(k, 0.0)
            self.survival.setdefault(k, Decayed()).add(accepted, verified, obs.time, decay)
        for b in set(self.lookup) | set(obs.drafting_rows):
            tokens = obs.lookup_accepted.get(b, 0.0) - previous.lookup_accepted.get(b, 0.0)
            rows = obs.drafting_rows.get(b, 0.0) - previous.drafting_rows.get(b, 0.0)
            self.lookup.setdefault(b, Decayed()).add(tokens, rows, obs.time, decay)

    def comparable_means(self, bucket: str, blocks: Iterable[int], min_steps: float) -> dict[int, float]:
        """Mean step times of the bucket's ``blocks``, each carried to the present
        by the bucket's most recently run block (the reference): scaled by how much
        the reference has changed since the block last ran, if the reference's mean
        then rested on ``min_steps`` (decayed) steps. Growing contexts and a busier
        machine slow every block alike, so raw means from different moments compare
        moments, not blocks. A block without a snapshot of the reference is carried
        by the most recent block it has one of, itself carried first (levels chain)."""
        cells = {b: self.step_time[(bucket, b)] for b in blocks}
        carried: dict[int, float] = {}
        for b in sorted(cells, key=lambda b: (cells[b].last_update, cells[b].samples), reverse=True):
            snapshot = self.peers_at_update.get((bucket, b), {})
            level = 1.0
            for reference, now in carried.items():  # most recent first
                then, count = snapshot.get(reference, (0.0, 0.0))
                if then > 0 and count >= min_steps:
                    level = now / then
                    break
            carried[b] = cells[b].mean * level
        return {b: carried[b] for b in cells}

    def record_pair(self, cell: Cell, partner: int, ratio: float, steps: float) -> None:
        """A paired measurement: ``cell``'s block ran ``ratio`` times the step time
        of the bucket's ``partner`` block, the two taking turns step by step.
        The cell's mean becomes ``ratio`` x the partner's mean, resting on
        ``steps`` steps, and each cell's snapshot of the other is the pair, so
        carrying either to the present (``comparable_means``) keeps the ratio
        whichever of them runs on."""
        bucket, block = cell
        partner_cell = self.step_time[(bucket, partner)]
        own = self.step_time.setdefault(cell, Decayed())
        own.total, own.count = ratio * partner_cell.mean * steps, steps
        self.peers_at_update.setdefault(cell, {})[partner] = (partner_cell.mean, partner_cell.count)
        self.peers_at_update.setdefault((bucket, partner), {})[block] = (own.mean, own.count)

    def busy_since(self, cell: Cell) -> float:
        """Seconds the cell's bucket has decoded since the cell last ran (inf if
        never): its staleness counted in the bucket's own traffic, not in idle time."""
        if cell not in self.busy_at_update:
            return float("inf")
        return self.busy.get(cell[0], 0.0) - self.busy_at_update[cell]

    def measured_survival(self, position: int, min_verified: float) -> float | None:
        """S_k where at least ``min_verified`` (undecayed) drafts were verified, else None."""
        d = self.survival.get(position)
        if d is None or d.samples < min_verified or d.count <= 0:
            return None
        return min(1.0, max(0.0, d.mean))

    def survival_curve(self, max_position: int, min_verified: float) -> list[float]:
        """S_1..S_max. Positions with at least ``min_verified`` (undecayed) verified
        drafts are measured, clipped so the curve never rises (draft k is accepted
        only after draft k - 1; positions measured on different blocks and moments
        can disagree); later ones continue geometrically (a guess, refined once
        tried) with ``_tail_ratio``; with nothing measured, 0 (no evidence that
        drafting pays)."""
        curve: list[float] = []
        ratio: float | None = None
        for k in range(1, max_position + 1):
            measured = self.measured_survival(k, min_verified)
            if measured is not None:
                curve.append(min(measured, curve[-1]) if curve else measured)
                ratio = None
            elif not curve:
                curve.append(0.0)
            else:
                ratio = _tail_ratio(curve) if ratio is None else ratio
                curve.append(curve[-1] * ratio)
        return curve

    def lookup_measured(self, block_size: int, min_verified: float) -> bool:
        """Whether ``min_verified`` (undecayed) row-rounds at ``block_size`` measured its lookup tokens."""
        d = self.lookup.get(block_size)
        return d is not None and d.samples >= min_verified and d.count > 0

    def lookup_tokens(self, block_size: int, min_verified: float) -> float:
        """Tokens n-gram lookup adds to a drafting row-round at ``block_size``
        beyond the draft's (``--lookup``), as measured at the nearest block with
        ``min_verified`` row-rounds (the smaller on a tie); 0 at b = 1 or with
        none measured. Each block reads its own: the longer the chain, the more
        of what a lookup path would commit the draft's slots already commit (on
        MT-Bench 0.00 tokens at b16 against 0.34 at b2, docs/LOG.md). One
        figure for every block let the start's b16 steps price lookup at
        nothing, and the lone-request bucket stayed on plain decoding."""
        measured = {b: d.mean for b, d in self.lookup.items() if b > 1 and self.lookup_measured(b, min_verified)}
        if block_size < 2 or not measured:
            return 0.0
        nearest = min(measured, key=lambda b: (abs(b - block_size), b))
        return max(0.0, measured[nearest])

    def survival_upper_bound(self, max_position: int, min_verified: float) -> list[float]:
        """S_1..S_max where measured; an unmeasured position is at most the survival
        before it (1.0 before any measurement): what a block could reach, for
        deciding whether trying it is worth its cost."""
        bound, last = [], 1.0
        for k in range(1, max_position + 1):
            measured = self.measured_survival(k, min_verified)
            if measured is not None:
                last = min(last, measured)
            bound.append(last)
        return bound


def expected_acceptance_length(survival: list[float], block_size: int, lookup_tokens: float = 0.0) -> float:
    """E[tau(b)] = 1 + sum_{k<b} S_k (+ lookup's tokens for b > 1): the bonus
    token, each surviving draft, and what lookup paths add in drafting rounds."""
    return 1.0 + sum(survival[: block_size - 1]) + (lookup_tokens if block_size > 1 else 0.0)


def _tail_ratio(curve: list[float]) -> float:
    """S_(k+1) / S_k beyond the measured positions: the smaller of the last
    measured ratio and the mean ratio since S_1, (S_m / S_1) ** (1 / (m - 1)), so
    a few lucky long runs at the measured tail are not stretched over the whole
    block. With S_1 alone: S_1."""
    if len(curve) == 1:
        return curve[0]
    last = curve[-1] / curve[-2] if curve[-2] > 0 else 0.0
    mean = (curve[-1] / curve[0]) ** (1 / (len(curve) - 1)) if curve[0] > 0 else 0.0
    return min(last, mean, 1.0)


def _restarted(previous: Observation, obs: Observation) -> bool:
    counts = [(obs.step_seconds.get(c, (0, 0))[1], v[1]) for c, v in previous.step_seconds.items()]
    return (
        any(now < before for now, before in counts)
        or any(obs.verified.get(k, 0.0) < v for k, v in previous.verified.items())
        or any(obs.drafting_rows.get(b, 0.0) < rows for b, rows in previous.drafting_rows.items())
    )
