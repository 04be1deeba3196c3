"""What flows between the API and an engine: requests in, deltas out, stats,
and the block-size policy."""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from speculative.sampling import SamplingParams


class EngineError(Exception):
    """Base of the errors an engine raises to the API layer."""


class QueueFullError(EngineError):
    """The waiting queue is full: the API answers 429 with Retry-After."""


class EngineStoppedError(EngineError):
    """The engine is draining or stopped and admits nothing new: 503."""


class InvalidRequestError(EngineError):
    """A request the engine cannot serve as asked (e.g. too long): 400."""


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: prompt token ids and how to continue them."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecStats:
    """Per-request speculation so far: rounds verified, drafts verified and
    accepted; acceptance length = committed tokens per round."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_length(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class Delta:
    """New output of one request: text and token ids since the last delta; the
    last delta of a request carries ``finish_reason`` ("stop", "length", "abort")."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)


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


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and readiness."""

    running: int
    waiting: int
    block_size: int
    draining: bool


class Engine(Protocol):
    """What the API needs from an engine (native today, SGLang next)."""

    @property
    def context_length(self) -> int:
        """Prompt + completion tokens a request may use at most."""
        ...

    @property
    def max_block_size(self) -> int:
        """Largest block size the engine can verify (1: no draft)."""
        ...

    @property
    def policy(self) -> BlockPolicy:
        """The block-size policy in force."""
        ...

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float | None = None) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """Admit ``request`` and stream its deltas; closing the iterator aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def set_policy(self, policy: BlockPolicy) -> None: ...
