"""``--engine sglang``: SGLang's in-process ``sglang.Engine`` behind the same
``Engine`` protocol as the native engine (GPUs; scale-out).

The target runs with ``--speculative-algorithm DFLASH_ADAPTIVE`` (our plugin,
``speculative.sglang``) so the block-size policy reaches every scheduler through
``collective_rpc``. Streaming: SGLang's chunks carry cumulative ``output_ids``;
each becomes a ``Delta`` of the new ids, detokenised by the same ``TextStream``
as the native engine (same text, same stop-string handling). Leaving the
iteration early aborts the request in SGLang.

Step metrics: the plugin's workers count steps, device seconds and per-position
acceptance per (batch size, b) in every scheduler; the engine reads them through
``get_internal_state`` every ``poll_interval_s`` and adds what is new to the same
Prometheus metrics the native engine feeds, so dashboards and the controller
work the same on both engines.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from service.config import ServeSettings
from service.engine.text import Decoder, TextStream
from service.engine.types import (
    BlockPolicy,
    Delta,
    EngineStats,
    EngineStoppedError,
    GenerateRequest,
    InvalidRequestError,
    QueueFullError,
    SpecStats,
    check_fits,
)
from service.metrics import Metrics
from speculative.config import DFlashConfig
from speculative.policy import check_policy
from speculative.session import RoundStats
from speculative.sglang.logic import ADAPTIVE_ALGORITHM, StepCell, StepCounters

log = logging.getLogger(__name__)

FINISH_REASONS: dict[object, str] = {"stop": "stop", "length": "length", "abort": "abort"}  # keyed by what SGLang sent


def server_args(settings: ServeSettings, draft_block_size: int) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments for ``settings`` (the DFlash draft at
    its trained block: the KV reserve and CUDA graphs are sized for it), then
    ``settings.sglang_args`` (the user's, e.g. ``tp_size``; they win)."""
    args: dict[str, Any] = {
        "model_path": str(settings.target),
        "device": settings.device,
        "max_running_requests": settings.max_batch_size,
        "incremental_streaming_output": False,
        "log_level": "warning",
    }
    if settings.draft is not None:
        args |= {
            "speculative_algorithm": ADAPTIVE_ALGORITHM,
            "speculative_draft_model_path": str(settings.draft),
            "speculative_num_draft_tokens": draft_block_size,
        }
    return args | settings.sglang_args


def sampling_params(request: GenerateRequest) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ``request`` (top_k -1 = off in SGLang)."""
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": request.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "min_p": s.min_p,
        "stop_token_ids": list(request.stop_token_ids),
        "stop": list(request.stop),
        "skip_special_tokens": True,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "min_new_tokens": s.min_tokens,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.grammar is not None:
        params[s.grammar.kind] = s.grammar.source  # SGLang's "json_schema" / "regex" sampling params
    if s.logit_bias:
        # SGLang's DFlash verify adds it to the target's logits (``dflash_utils``) and checks the ids.
        params["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    return params


def finish_reason(meta_info: dict[str, Any]) -> str | None:
    """SGLang's ``finish_reason`` ({"type": "stop"|"length"|"abort", ...} or None)."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    return FINISH_REASONS.get(reason.get("type") if isinstance(reason, dict) else str(reason), "abort")


def spec_stats(meta_info: dict[str, Any]) -> SpecStats:
    """Per-request speculation counters (present on SGLang's final chunk only).
    ``spec_num_proposed_drafts`` is SGLang's verify count x (start-up block - 1),
    an upper bound when the block changes per step; rounds and accepted are exact."""
    return SpecStats(
        rounds=int(meta_info.get("spec_verify_ct", 0)),
        drafted=int(meta_info.get("spec_num_proposed_drafts", 0)),
        accepted=int(meta_info.get("spec_num_correct_drafts", 0)),
    )


def step_stats(batch_size: int, block_size: int, cell: StepCell) -> RoundStats:
    """``cell.steps`` steps of one (batch size, b) as the summed stats the
    metrics take (every row verifies every draft position of its block)."""
    return RoundStats(
        batch_size=batch_size,
        block_size=block_size,
        committed=[],
        accepted_per_position=list(cell.accepted_per_position),
        verified_per_position=[cell.steps * batch_size] * (block_size - 1),
        draft_seconds=0.0,
        verify_seconds=cell.seconds,
    )


class SGLangEngine:
    """The service's engine on SGLang. ``runtime``: a started ``sglang.Engine``
    (anything with ``async_generate``, ``collective_rpc``, ``tokenizer_manager``
    and ``shutdown``); ``metrics``: where the schedulers' step counters go."""

    def __init__(
        self,
        runtime: Any,
        tokenizer: Decoder,
        *,
        max_block_size: int,
        context_length: int,
        max_batch_size: int,
        max_waiting: int,
        metrics: Metrics | None = None,
        poll_interval_s: float = 2.0,
    ) -> None:
        self.runtime, self.tokenizer, self.metrics = runtime, tokenizer, metrics
        self.poll_interval_s = poll_interval_s
        self._steps_seen = StepCounters()
        self._poller: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._max_block_size, self._context_length = max_block_size, context_length
        self.capacity, self.max_batch_size = max_batch_size + max_waiting, max_batch_size
        self._policy = BlockPolicy.fixed(max_block_size)
        self._rpc_lock = threading.Lock()  # one RPC socket: collective_rpc is not thread-safe
        self._in_flight: set[str] = set()
        self._draining = False

    @classmethod
    def from_settings(cls, settings: ServeSettings, tokenizer: Decoder, metrics: Metrics) -> SGLangEngine:
        """Start ``sglang.Engine`` for ``settings`` (imports SGLang); step
        metrics go to ``metrics``."""
        import sglang

        block = DFlashConfig.from_file(settings.draft / "config.json").block_size if settings.draft else 1
        runtime = sglang.Engine(**server_args(settings, block))
        context = int(runtime.tokenizer_manager.context_len)
        engine = cls(
            runtime,
            tokenizer,
            max_block_size=block,
            context_length=context,
            max_batch_size=settings.max_batch_size,
            max_waiting=settings.max_waiting,
            metrics=metrics,
        )
        if settings.draft:
            engine.rpc("dflash_probe")  # fails loudly if the plugin is not active
            if settings.block_size:
                engine.set_policy(BlockPolicy.fixed(settings.block_size))
        return engine

    # ------------------------------------------------------------------ control

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def max_block_size(self) -> int:
        return self._max_block_size

    @property
    def policy(self) -> BlockPolicy:
        return self._policy

    def start(self) -> None:
        """SGLang's processes already run (started by ``from_settings``); with a
        draft and metrics, start reading the step counters (call from the
        serving event loop, as the app's lifespan does)."""
        self._loop = asyncio.get_running_loop()
        if self.metrics is not None and self._max_block_size > 1:
            self._poller = self._loop.create_task(self._poll_forever())

    async def poll_steps(self) -> None:
        """Add the steps the schedulers counted since the last poll to the metrics."""
        states = await self.runtime.tokenizer_manager.get_internal_state()
        reports = [state["dflash_adaptive"]["steps"] for state in states if "dflash_adaptive" in state]
        if not reports or self.metrics is None:
            return
        counted = StepCounters.from_reports(reports)
        for (batch, b), cell in counted.since(self._steps_seen).cells.items():
            self.metrics.observe_steps(step_stats(batch, b, cell), cell.seconds, cell.steps)
        self._steps_seen = counted

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_steps()
            except Exception:  # keep serving; the next poll catches up (counters are cumulative)
                log.exception("reading SGLang's step counters failed")

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; abort in-flight requests unless draining; shut SGLang down."""
        self._draining = True
        if self._poller is not None:
            assert self._loop is not None  # start() set it with the poller
            self._loop.call_soon_threadsafe(self._poller.cancel)
        if not drain:
            for rid in list(self._in_flight):
                self.abort(rid)
        self.runtime.shutdown()

    def rpc(self, method: str, **kwargs: Any) -> None:
        """``collective_rpc`` to every scheduler (serialised; raises on failure)."""
        with self._rpc_lock:
            self.runtime.collective_rpc(method, **kwargs)

    def set_policy(self, policy: BlockPolicy) -> None:
        """Send ``policy`` to every scheduler; blocks up to one scheduler iteration."""
        check_policy(policy, self._max_block_size)
        self.rpc("dflash_set_policy", policy_json=policy.to_json())
        self._policy = policy

    def profile_steps(self, batch_sizes: Sequence[int], steps: int) -> None:
        """No start-up profile: SGLang's schedulers own the batches."""
        return None

    def stats(self) -> EngineStats:
        """In-flight requests split at ``max_batch_size`` (SGLang's own queue is
        not visible here), the policy's block at that batch size, draining."""
        running = min(len(self._in_flight), self.max_batch_size)
        block = self._policy.block_size(max(1, running))
        return EngineStats(running, len(self._in_flight) - running, block, self._draining)

    # ----------------------------------------------------------------- requests

    def abort(self, request_id: str) -> None:
        self.runtime.tokenizer_manager.abort_request(rid=request_id)

    def _admit(self, request: GenerateRequest) -> None:
        if self._draining:
            raise EngineStoppedError("the server is shutting down")
        if not request.prompt_ids or request.max_tokens < 1:
            raise InvalidRequestError("the prompt is empty or max_tokens < 1")
        if request.sampling.logprobs is not None or request.sampling.prompt_logprobs is not None:
            raise InvalidRequestError("logprobs need the native engine (--engine native)", param="logprobs")
        check_fits(request, self._context_length, self._max_block_size)
        if len(self._in_flight) >= self.capacity:
            raise QueueFullError(f"{len(self._in_flight)} requests in flight")
        self._in_flight.add(request.request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream ``request`` through SGLang; leaving early aborts it there."""
        self._admit(request)
        text, sent, upstream_done = TextStream(self.tokenizer, request.stop), 0, False
        try:
            stream = await self.runtime.async_generate(
                input_ids=list(request.prompt_ids),
                sampling_params=sampling_params(request),
                stream=True,
                rid=request.request_id,
            )
            async for chunk in stream:
                meta = chunk["meta_info"]
                ids = chunk["output_ids"]
                new, sent = tuple(ids[sent:]), len(ids)
                finish = finish_reason(meta)
                upstream_done = finish is not None
                piece = text.push(new, final=upstream_done)
                if text.stopped:  # our stop-string match may precede SGLang's own
                    finish = "stop"
                yield Delta(
                    piece,
                    new,
                    finish,
                    int(meta.get("prompt_tokens", len(request.prompt_ids))),
                    int(meta.get("completion_tokens", sent)),
                    spec_stats(meta),
                )
                if finish is not None:
                    return
        finally:
            self._in_flight.discard(request.request_id)
            if not upstream_done:  # client gone or our stop string: free SGLang's slot
                self.abort(request.request_id)
