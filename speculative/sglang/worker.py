"""``AdaptiveDFlashWorker``: SGLang 0.5.23's ``DFlashWorkerV2`` with the block
size chosen per decode step from a policy table (batch size -> b).

Imported only inside SGLang processes (it imports SGLang at module level).

What stays correct when b changes between steps:
- KV reserve: the published spec value ``speculative_num_draft_tokens`` stays at
  the trained block B for the whole run, so each request keeps ``2 * B`` slots
  reserved (``DFlashDraftInputV2.prepare_for_decode``) which covers any
  previous + next b <= B. It is never overridden per step.
- Buffers and block-shaped inputs: one set per b (``BlockStateCache``).
- Accept accounting: every ``GenerationBatchResult`` carries its own
  ``speculative_num_draft_tokens`` (the stride the scheduler uses to read the
  committed tokens), and ``StepCounters`` counts positions per step's b.
- Step metrics: ``StepCounters`` keeps steps, device seconds (CUDA events around
  the step) and per-position acceptance per (batch size, b), reported through
  ``get_internal_state`` for the service's Prometheus metrics and controller.
- CUDA graphs: upstream captures the target-verify and draft graphs at width
  B. ``init_cuda_graphs`` then captures one more set per block size of
  ``GRAPH_BLOCKS_ENV`` (default: the controller's candidates), as SGLang's
  adaptive EAGLE keeps one runtime state per step count: for each b, a new
  attention backend (its own graph buffers) and a graph runner of the same
  class at width b for the target and the draft, and the draft sampler folded
  into the draft graph, captured while SGLang's spec config, the worker's block
  state and the draft model read b. A step swaps in its b's set
  (``BlockRuntime``); a block without one (a policy pushed with other sizes)
  runs on B's set, eagerly, since the graphs reject its width. Every step
  counts whether the target replayed a graph (``graph_steps``).
- Plain steps (b = 1, with ``PLAIN_STEPS_ENV`` = "1"): the draft runner's
  forward is stubbed for the step (``_draft_forward_skipped``), so upstream
  proposes nothing and verifies the anchor alone; the committed token's
  target features are appended to the draft's context after verify as in any
  step (upstream writes them right after accept, nothing carries over), so a
  later drafting step sees the whole context. The target gets a graph set at
  width 1; the draft keeps the trained block's (it does not run).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.model_runner import ModelRunnerOutput
from sglang.srt.runtime_context import get_context, get_disagg, get_exec, get_spec
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import (
    build_block_pos_offsets,
    make_draft_block_spec_info,
    make_draft_sampler_capture_hook,
)
from sglang.srt.speculative.spec_utils import draft_pp_context, draft_tp_context

from speculative.policy import BlockPolicy, Turns, check_policy
from speculative.sglang.logic import (
    GRAPH_BLOCKS_ENV,
    PLAIN_STEPS_ENV,
    BlockRuntime,
    BlockStateCache,
    StepCounters,
    graph_block_sizes,
    smallest_block_size,
    step_block_size,
)

log = logging.getLogger(__name__)


# SGLang is not importable where this module is type-checked: its classes and the
# objects they hand over (batches, model runners, backends, hooks) are ``Any``.
class AdaptiveDFlashWorker(DFlashWorkerV2):  # type: ignore[misc]  # DFlashWorkerV2 is Any (see above)
    """DFlash draft worker whose verify block follows ``policy`` every step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained_block_size = int(self.block_size)
        argmax_draft = self.selector is None and self.lilicorr is None and not self._is_domino
        self.smallest_block = smallest_block_size(os.environ.get(PLAIN_STEPS_ENV), argmax_draft)
        self.block_policy = BlockPolicy.fixed(self.trained_block_size)
        self.block_turns = Turns()
        self.block_states = BlockStateCache(self, self._fresh_block_state)
        self.step_counters = StepCounters()
        self.block_runtimes: dict[int, BlockRuntime] = {}
        self._pending: list[_PendingStep] = []
        self._logged_modes: set[tuple[int, bool]] = set()

    def init_cuda_graphs(self) -> None:
        """Upstream's graphs at the trained block, then one set per other block
        of ``GRAPH_BLOCKS_ENV`` (none when upstream captured no draft or target
        graphs: CUDA graphs disabled, or a configuration upstream runs eagerly)."""
        draft_runner = self.draft_model_runner
        hooks_before = list(draft_runner.capture_tail_hooks)
        super().init_cuda_graphs()
        trained = self.trained_block_size
        self.block_runtimes = {trained: self._current_runtime()}
        blocks = graph_block_sizes(os.environ.get(GRAPH_BLOCKS_ENV), trained, self.smallest_block)
        if not (_owns_graphs(self._target_worker.model_runner) and _owns_graphs(draft_runner)):
            log.info("no CUDA graphs at the trained block %d: every block size runs eagerly", trained)
            return
        if get_exec().overlap.enable_two_batch_overlap or get_disagg().enable_pdmux:
            # Both wrap or split the attention backend per stream; a fresh plain
            # backend per block would bypass that.
            log.warning("two-batch overlap / PD multiplexing: CUDA graphs at block %d only", trained)
            return
        for block in blocks:
            if block != trained:
                started = time.perf_counter()
                self.block_runtimes[block] = self._capture_runtime(block, self.block_runtimes[trained], hooks_before)
                log.info("captured DFlash graphs for block %d in %.1f s", block, time.perf_counter() - started)
        self._apply_runtime(self.block_runtimes[trained])  # whatever a capture left set

    def _current_runtime(self) -> BlockRuntime:
        target, draft = self._target_worker.model_runner, self.draft_model_runner
        return BlockRuntime(
            target.attn_backend,
            target.decode_cuda_graph_runner,
            draft.attn_backend,
            draft.decode_cuda_graph_runner,
            self._draft_sampler,
        )

    def _apply_runtime(self, runtime: BlockRuntime) -> None:
        target, draft = self._target_worker.model_runner, self.draft_model_runner
        target.attn_backend, target.decode_cuda_graph_runner = runtime.target_attn_backend, runtime.target_graph_runner
        draft.attn_backend, draft.decode_cuda_graph_runner = runtime.draft_attn_backend, runtime.draft_graph_runner
        self._draft_sampler = runtime.draft_sampler

    def _capture_runtime(self, block: int, trained: BlockRuntime, draft_hooks: list[Any]) -> BlockRuntime:
        """Backends and graphs for ``block``: what upstream builds at start-up for
        the ``trained`` block, built again while everything it reads says ``block``.
        ``draft_hooks``: the draft runner's capture hooks other than the trained
        block's sampler (which folds B-wide argmaxes into the graph). A plain
        step (b = 1) runs no draft: the draft keeps the trained block's set."""
        target, draft = self._target_worker.model_runner, self.draft_model_runner
        with self._capturing_at(block):
            target_backend = _fresh_attention_backend(target)
            target_graphs = type(trained.target_graph_runner)(
                target, attn_backend=target_backend, speculative_num_draft_tokens=block
            )
            if block == 1:
                return BlockRuntime(
                    target_backend, target_graphs, trained.draft_attn_backend, trained.draft_graph_runner, None
                )
            with draft_pp_context(), draft_tp_context(self.draft_parallel_layout):
                draft_backend = _fresh_attention_backend(draft)
                sampler = self._maybe_build_draft_sampler()  # reads self.block_size
                sampler_hooks = [make_draft_sampler_capture_hook(sampler)] if sampler is not None else []
                trained_hooks, draft.capture_tail_hooks = draft.capture_tail_hooks, [*draft_hooks, *sampler_hooks]
                try:
                    draft_graphs = type(trained.draft_graph_runner)(
                        draft, attn_backend=draft_backend, speculative_num_draft_tokens=block
                    )
                finally:
                    draft.capture_tail_hooks = trained_hooks
        return BlockRuntime(target_backend, target_graphs, draft_backend, draft_graphs, sampler)

    @contextlib.contextmanager
    def _capturing_at(self, block: int) -> Iterator[None]:
        """SGLang's spec config, the worker's block state and the draft model at
        ``block`` (as adaptive EAGLE overrides them for its captures); restored after."""
        published = get_spec().speculative_num_draft_tokens
        get_context().override("adaptive_spec.capture_override", speculative_num_draft_tokens=block)
        self._use_block(block)
        try:
            yield
        finally:
            get_context().override("adaptive_spec.capture_restore", speculative_num_draft_tokens=published)
            self._use_block(self.trained_block_size)

    def _use_block(self, block: int) -> bool:
        """The worker's block-shaped state and the draft model at ``block``; True when that changed them."""
        if not self.block_states.activate(block):
            return False
        self.draft_model.set_block_size(block)
        return True

    def set_block_policy(self, policy: BlockPolicy) -> None:
        """Use ``policy`` from the next decode step on (ValueError if it does not fit)."""
        check_policy(policy, self.trained_block_size)
        self.block_policy = policy
        log.info("DFlash block policy %s", policy)

    def forward_batch_generation(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        if decode:
            batch_size = len(batch.seq_lens)
            block = step_block_size(
                self.block_policy, batch_size, self.trained_block_size, self.block_turns, self.smallest_block
            )
            if self._use_block(block) and self.block_runtimes:
                self._apply_runtime(self.block_runtimes.get(block, self.block_runtimes[self.trained_block_size]))
            started = _StepClock.start(self.device)
        with self._draft_forward_skipped() if decode and block == 1 else contextlib.nullcontext():
            result = super().forward_batch_generation(batch, *args, **kwargs)
        if decode and result.accept_lens is not None:
            block, graph = int(result.speculative_num_draft_tokens), bool(result.can_run_cuda_graph)
            if (block, graph) not in self._logged_modes:  # once each: the log shows which blocks replay graphs
                self._logged_modes.add((block, graph))
                log.info("DFlash block %d: verify %s", block, "replays a CUDA graph" if graph else "runs eagerly")
            self._record_step(result.accept_lens, block, started, graph)
        return result

    @contextlib.contextmanager
    def _draft_forward_skipped(self) -> Iterator[None]:
        """For a plain step: the draft runner's forward returns at once a
        one-column placeholder for its hidden states, so upstream's argmax over
        block slots 1.. has no rows and proposes nothing, and the step runs no
        draft model. Verify, accept and the append of the committed token's
        features to the draft context are upstream's, unchanged."""
        runner = self.draft_model_runner
        earlier = vars(runner).get("forward")
        runner.forward = _skipped_draft_forward
        try:
            yield
        finally:
            if earlier is None:
                del runner.forward
            else:
                runner.forward = earlier

    def _fresh_block_state(self, block: int) -> dict[str, object]:
        """Attribute values for a block size not used yet: the block-shaped
        inputs at width ``block`` and empty buffers (the upstream worker
        allocates them at the current ``block_size`` on first use)."""
        return {
            "block_size": block,
            "speculative_num_draft_tokens": block,
            "_block_pos_offsets": build_block_pos_offsets(length=block, device=self.device),
            "_draft_block_spec_info": make_draft_block_spec_info(draft_token_num=block, device=self.device),
            "_draft_block_ids_buf": None,
            "_draft_block_positions_buf": None,
            "_draft_block_tokens_buf": None,
            "_draft_verify_out_cache_loc_buf": None,
            "_draft_block_end_buf": None,
            "_draft_seq_lens_cpu_buf": None,
            "_accept_bonus_buffer_cap": 0,
            "_accept_len_buf": None,
            "_commit_lens_bufs": None,
            "_bonus_id_bufs": None,
            "_out_tokens_bufs": None,
            "_new_seq_lens_bufs": None,
        }

    def _record_step(self, commit_lens: torch.Tensor, block: int, started: _StepClock, graph: bool) -> None:
        """Queue this step's commit lengths (accepted drafts + 1) and timing for
        counting without a device sync: copied asynchronously, folded once the
        step's end event has completed (a later step), so overlap scheduling is kept."""
        # Pinned memory (PyTorch's caching host allocator) makes the copy truly asynchronous.
        host = torch.empty(commit_lens.shape, dtype=commit_lens.dtype, pin_memory=commit_lens.is_cuda)
        host.copy_(commit_lens, non_blocking=True)
        self._pending.append(_PendingStep(host, block, started.stop(), graph))
        while self._pending and self._pending[0].clock.done():
            step = self._pending.pop(0)
            drafts = [n - 1 for n in step.commit_lens.tolist()]
            self.step_counters.add_step(drafts, step.block, step.clock.seconds(), step.graph)


class _StepClock:
    """Device time of one step: CUDA events on the current stream (read once the
    end event completes), or wall time on other devices (synchronous there)."""

    def __init__(self, start: torch.cuda.Event | float) -> None:
        self.begin = start
        self.end: torch.cuda.Event | float | None = None  # set by stop(), of start's kind

    @classmethod
    def start(cls, device: torch.device | str) -> _StepClock:
        if torch.device(device).type != "cuda":
            return cls(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record()
        return cls(event)

    def stop(self) -> _StepClock:
        if isinstance(self.begin, float):
            self.end = time.perf_counter()
        else:
            self.end = end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as in start
            end.record()
        return self

    def done(self) -> bool:
        end = self.end
        if isinstance(end, float):
            return True
        assert end is not None, "done() before stop()"
        finished: bool = end.query()  # type: ignore[no-untyped-call]  # unannotated in torch
        return finished

    def seconds(self) -> float:
        begin, end = self.begin, self.end
        if isinstance(begin, float):
            assert isinstance(end, float), "seconds() before stop()"
            return end - begin
        assert end is not None and not isinstance(end, float), "seconds() before stop()"
        milliseconds: float = begin.elapsed_time(end)
        return milliseconds / 1e3


class _PendingStep(NamedTuple):
    commit_lens: torch.Tensor
    block: int
    clock: _StepClock
    graph: bool


def _skipped_draft_forward(forward_batch: Any, *args: Any, **kwargs: Any) -> ModelRunnerOutput:
    """What a plain step's draft forward returns: hidden states [bs, 1] (upstream
    views them as [bs, 1, 1] and drafts from slots 1.., of which there are none)."""
    placeholder = torch.empty((forward_batch.batch_size, 1), device=forward_batch.input_ids.device)
    return ModelRunnerOutput(LogitsProcessorOutput(next_token_logits=None, hidden_states=placeholder), False)


def _owns_graphs(model_runner: Any) -> bool:
    """Whether the runner captured decode graphs (a draft runner that did not
    holds its eager runner there instead)."""
    runner = model_runner.decode_cuda_graph_runner
    return runner is not None and runner is not getattr(model_runner, "eager_runner", None)


def _fresh_attention_backend(model_runner: Any) -> Any:
    """A new attention backend of the runner's kind with its own workspace (a
    graph runner sizes its backend's graph buffers to its width; sharing one
    backend would resize the trained block's buffers under its graphs), bound
    to the runner's KV index translator as its start-up backends are."""
    flag = model_runner.init_new_workspace
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = flag
    model_runner.kv_index_translator.bind_and_verify_backends([backend])
    return backend
