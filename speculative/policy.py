"""The block-size policy: which DFlash block to verify at each batch size.

Shared by the native engine, the controller, the admin API and the SGLang
plugin (which receives it as JSON through ``collective_rpc``).
"""

from __future__ import annotations

import bisect
import collections
import json
from dataclasses import dataclass, field
from typing import Any

CANDIDATE_BLOCK_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16)
"""The block sizes the controller chooses among by default (1 = plain
decoding); the SGLang plugin captures CUDA graphs for these."""


@dataclass(frozen=True)
class BlockPolicy:
    """Block size per batch-size range: ``block_sizes[i]`` applies to batches of at
    least ``min_batch[i]`` rows (``min_batch[0] == 1``); b = 1 means plain decoding.

    ``alternates`` (optional, one per range): a block that takes turns with
    ``block_sizes[i]`` step by step within the range (equal: no turns). The
    controller runs its trials so: both blocks then see the same moments of a
    machine whose speed drifts, and their step times compare as a pair."""

    min_batch: tuple[int, ...] = (1,)
    block_sizes: tuple[int, ...] = (16,)
    alternates: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.min_batch or len(self.min_batch) != len(self.block_sizes):
            raise ValueError("min_batch and block_sizes must be non-empty and of equal length")
        if self.min_batch[0] != 1 or list(self.min_batch) != sorted(set(self.min_batch)):
            raise ValueError(f"min_batch must start at 1 and increase, got {self.min_batch}")
        if self.alternates and len(self.alternates) != len(self.block_sizes):
            raise ValueError("alternates must be empty or as long as block_sizes")
        if min(self.block_sizes + self.alternates) < 1:
            raise ValueError(f"block sizes must be >= 1, got {self.block_sizes} / {self.alternates}")

    @classmethod
    def fixed(cls, block_size: int) -> BlockPolicy:
        """The same block size at every batch size."""
        return cls((1,), (block_size,))

    def entry(self, batch_size: int) -> int:
        """Index of the range a batch of ``batch_size`` rows falls in."""
        return bisect.bisect_right(self.min_batch, batch_size) - 1

    def block_size(self, batch_size: int, turn: int = 0) -> int:
        """The block size for a batch of ``batch_size`` rows at its range's
        ``turn``-th step (odd turns run the range's alternate)."""
        i = self.entry(batch_size)
        return self.alternates[i] if self.alternates and turn % 2 else self.block_sizes[i]

    @property
    def largest(self) -> int:
        """The largest block the policy can run."""
        return max(self.block_sizes + self.alternates)

    def to_dict(self) -> dict[str, list[int]]:
        """``{"min_batch": [...], "block_sizes": [...]}`` (and ``"alternates"``
        where set): the admin API body."""
        out = {"min_batch": list(self.min_batch), "block_sizes": list(self.block_sizes)}
        return out | ({"alternates": list(self.alternates)} if self.alternates else {})

    @classmethod
    def from_dict(cls, raw: object) -> BlockPolicy:
        """Parse ``to_dict`` output; ValueError on anything else."""
        body: Any = raw  # any shape: a wrong one raises TypeError/KeyError/AttributeError below
        try:
            return cls(
                tuple(int(x) for x in body["min_batch"]),
                tuple(int(x) for x in body["block_sizes"]),
                tuple(int(x) for x in body.get("alternates", ())),
            )
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a block policy: {raw!r}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> BlockPolicy:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a block policy: {text!r}") from exc
        return cls.from_dict(raw)


@dataclass
class Turns:
    """Steps taken per policy range, so a range with an alternate takes turns
    within its own batch sizes (one counter for all ranges could run only one
    of the pair when the batch flips between two ranges every other step)."""

    taken: collections.Counter[int] = field(default_factory=collections.Counter)

    def block_size(self, policy: BlockPolicy, batch_size: int) -> int:
        """The block for this step of a ``batch_size``-row batch; counts the turn."""
        i = policy.entry(batch_size)
        self.taken[i] += 1
        return policy.block_size(batch_size, self.taken[i] - 1)


def check_policy(policy: BlockPolicy, max_block_size: int) -> None:
    """A policy must fit the draft: ValueError naming both (the API answers 400,
    SGLang's RPC caller sees it)."""
    if policy.largest > max_block_size:
        raise ValueError(f"policy block sizes {policy.to_dict()} exceed the draft's block {max_block_size}")
