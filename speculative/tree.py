"""The shape of a verify block that holds more than one candidate path.

Slot 0 is the anchor; every other slot holds one candidate token and names its
parent slot, so the block is a tree of paths from the anchor. A round builds it
from segments, in this order (parents always come before their children):

  chain       slots 1..b-1: the DFlash draft, slot j after slot j-1;
  alternates  the draft's runner-up tokens for the first drafted slot, each after the anchor;
  lookup      an n-gram lookup continuation (``speculative.lookup``), a chain after the anchor.

A slot stands at the position of the anchor plus its depth and sees only its
ancestors and itself (``visibility``), so the target scores every path as if it
had been verified alone, in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import torch


@dataclass(frozen=True)
class DraftTree:
    """``parents[s]``: the parent slot of slot s (-1 for the anchor at slot 0)."""

    parents: tuple[int, ...]
    chain: int
    """Slots of the DFlash chain, the anchor included (the round's block size)."""
    alternates: int = 0
    lookup: int = 0

    @classmethod
    @cache  # one object per shape, so its tensors are built once
    def build(cls, block_size: int, alternates: int = 0, lookup: int = 0) -> DraftTree:
        parents = [-1, *range(block_size - 1)]
        parents += [0] * alternates
        start = len(parents)
        parents += [0, *range(start, start + lookup - 1)][:lookup]
        return cls(tuple(parents), block_size, alternates, lookup)

    @property
    def width(self) -> int:
        """Slots in the verify block."""
        return len(self.parents)

    @property
    def lookup_start(self) -> int:
        return self.chain + self.alternates

    def is_alternate(self, slots: torch.Tensor) -> torch.Tensor:
        """Which of ``slots`` (any shape) hold a first-slot alternate."""
        return (slots >= self.chain) & (slots < self.lookup_start)

    @cached_property
    def _ancestry(self) -> torch.Tensor:
        """[q, q] bool: ``[s, t]`` is True when t is s or one of its ancestors."""
        q = self.width
        ancestry = torch.eye(q, dtype=torch.bool)
        for slot, parent in enumerate(self.parents):
            if parent >= 0:
                ancestry[slot] |= ancestry[parent]
        return ancestry

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Per slot, the slots on its path after the anchor, in depth order, itself
        last (() for the anchor): the tokens a slot's prediction follows."""
        paths: list[tuple[int, ...]] = []
        for slot, parent in enumerate(self.parents):  # a parent always comes before its children
            paths.append(() if parent < 0 else (*paths[parent], slot))
        return tuple(paths)

    def visibility(self, device: torch.device) -> torch.Tensor:
        """[q, q] bool: the block slots each slot may attend to (its ancestors and itself)."""
        return self._ancestry.to(device)

    def depths(self, device: torch.device) -> torch.Tensor:
        """[q] int64: each slot's distance from the anchor, its position offset."""
        return self._ancestry.sum(dim=1).to(device) - 1

    def parent_index(self, device: torch.device) -> torch.Tensor:
        """[q] int64: each slot's parent, the anchor as its own (its token is never judged)."""
        return torch.tensor([max(p, 0) for p in self.parents], device=device)
