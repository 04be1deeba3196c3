"""What flows between the API and an engine: requests in, deltas out, stats,
and the block-size policy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from speculative.context import ContextLengthExceeded, check_context
from speculative.logprobs import TokenLogprob
from speculative.policy import BlockPolicy as BlockPolicy  # re-exported for the engines
from speculative.sampling import SamplingParams

if TYPE_CHECKING:
    from service.config import ServeSettings
    from service.engine.text import Decoder
    from service.metrics import Metrics
    from speculative.session import RoundStats


class EngineError(Exception):
    """Base of the errors an engine raises to the API layer."""


class QueueFullError(EngineError):
    """The waiting queue is full: the API answers 429 with Retry-After."""


class EngineStoppedError(EngineError):
    """The engine is draining or stopped and admits nothing new: 503."""


class InvalidRequestError(EngineError):
    """A request the engine cannot serve as asked (e.g. too long): 400, with
    the OpenAI error ``code`` and the ``param`` at fault when known."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def check_fits(request: GenerateRequest, context_length: int, block_size: int) -> None:
    """The context rule (``speculative.context``) as an engine refusal: 400
    ``context_length_exceeded`` naming ``max_tokens``."""
    try:
        check_context(context_length, len(request.prompt_ids), request.max_tokens, block_size)
    except ContextLengthExceeded as exc:
        raise InvalidRequestError(str(exc), code="context_length_exceeded", param="max_tokens") from exc


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: prompt token ids and how to continue them. ``group``:
    the generations of one API call (its ``n`` choices, its batched prompts)
    share one, so that admission can be fair across calls; "" (the default) is
    a group of its own."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    group: str = ""

    @property
    def group_key(self) -> str:
        return self.group or self.request_id


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
    logprobs: tuple[TokenLogprob, ...] = ()
    """Per token of ``token_ids`` when the request asked (``SamplingParams.logprobs``)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """On a request's first delta, per prompt token after the first, when it asked
    (``SamplingParams.prompt_logprobs``)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and readiness."""

    running: int
    waiting: int
    block_size: int
    draining: bool


class Engine(Protocol):
    """What the API needs from an engine (``native``, ``sglang``)."""

    @classmethod
    def from_settings(cls, settings: ServeSettings, tokenizer: Decoder, metrics: Metrics) -> Engine:
        """Build the engine ``dflash-serve`` was configured for."""
        ...

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

    def profile_steps(self, batch_sizes: Sequence[int], steps: int) -> list[tuple[RoundStats, float]] | None:
        """Time ``steps`` real steps per batch size and block size before serving
        (before ``start``): each step's stats and seconds, for step-time metrics
        only (the prompts are random, so acceptance means nothing). None: the
        engine cannot profile."""
        ...
