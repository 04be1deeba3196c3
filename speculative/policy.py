"""The block-size policy: which DFlash block to verify at each batch size.

Shared by the native engine, the controller, the admin API and the SGLang
plugin (which receives it as JSON through ``collective_rpc``).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockPolicy:
    """Block size per batch-size range: ``block_sizes[i]`` applies to batches of at
    least ``min_batch[i]`` rows (``min_batch[0] == 1``); b = 1 means plain decoding."""

    min_batch: tuple[int, ...] = (1,)
    block_sizes: tuple[int, ...] = (16,)

    def __post_init__(self) -> None:
        if not self.min_batch or len(self.min_batch) != len(self.block_sizes):
            raise ValueError("min_batch and block_sizes must be non-empty and of equal length")
        if self.min_batch[0] != 1 or list(self.min_batch) != sorted(set(self.min_batch)):
            raise ValueError(f"min_batch must start at 1 and increase, got {self.min_batch}")
        if min(self.block_sizes) < 1:
            raise ValueError(f"block sizes must be >= 1, got {self.block_sizes}")

    @classmethod
    def fixed(cls, block_size: int) -> BlockPolicy:
        """The same block size at every batch size."""
        return cls((1,), (block_size,))

    def block_size(self, batch_size: int) -> int:
        """The block size for a batch of ``batch_size`` rows."""
        return self.block_sizes[bisect.bisect_right(self.min_batch, batch_size) - 1]

    def to_dict(self) -> dict[str, list[int]]:
        """``{"min_batch": [...], "block_sizes": [...]}``: the admin API body."""
        return {"min_batch": list(self.min_batch), "block_sizes": list(self.block_sizes)}

    @classmethod
    def from_dict(cls, raw: object) -> BlockPolicy:
        """Parse ``to_dict`` output; ValueError on anything else."""
        try:
            return cls(tuple(int(x) for x in raw["min_batch"]), tuple(int(x) for x in raw["block_sizes"]))
        except (TypeError, KeyError) as exc:
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
