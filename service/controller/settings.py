"""The controller's decision settings (``dflash-controller`` makes one flag of
each field)."""

from __future__ import annotations

from dataclasses import dataclass

from speculative.policy import CANDIDATE_BLOCK_SIZES


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
        """The candidates the draft can verify, ascending."""
        return tuple(sorted(b for b in set(self.candidates) if b <= self.max_block_size))
