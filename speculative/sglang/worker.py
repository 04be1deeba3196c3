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
- CUDA graphs: upstream captures target-verify and draft graphs at width B
  only; a step at another b runs eagerly (SGLang's ``can_run_graph`` rejects
  the width), which is correct but forgoes graphs at that b. Per-b graph sets
  (as EAGLE's adaptive runtime states keep) are the next step.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info

from speculative.policy import BlockPolicy, Turns
from speculative.sglang.logic import BlockStateCache, StepCounters, check_policy, step_block_size

log = logging.getLogger(__name__)


class AdaptiveDFlashWorker(DFlashWorkerV2):
    """DFlash draft worker whose verify block follows ``policy`` every step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained_block_size = int(self.block_size)
        self.block_policy = BlockPolicy.fixed(self.trained_block_size)
        self.block_turns = Turns()
        self.block_states = BlockStateCache(self, self._fresh_block_state)
        self.step_counters = StepCounters()
        self._pending: list[_PendingStep] = []

    def set_block_policy(self, policy: BlockPolicy) -> None:
        """Use ``policy`` from the next decode step on (ValueError if it does not fit)."""
        check_policy(policy, self.trained_block_size)
        self.block_policy = policy
        log.info("DFlash block policy %s", policy)

    def forward_batch_generation(self, batch, *args, **kwargs):
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        if decode:
            block = step_block_size(self.block_policy, len(batch.seq_lens), self.trained_block_size, self.block_turns)
            if self.block_states.activate(block):
                self.draft_model.set_block_size(block)
            started = _StepClock.start(self.device)
        result = super().forward_batch_generation(batch, *args, **kwargs)
        if decode and result.accept_lens is not None:
            self._record_step(result.accept_lens, int(result.speculative_num_draft_tokens), started)
        return result

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

    def _record_step(self, commit_lens: torch.Tensor, block: int, started: _StepClock) -> None:
        """Queue this step's commit lengths (accepted drafts + 1) and timing for
        counting without a device sync: copied asynchronously, folded once the
        step's end event has completed (a later step), so overlap scheduling is kept."""
        # Pinned memory (PyTorch's caching host allocator) makes the copy truly asynchronous.
        host = torch.empty(commit_lens.shape, dtype=commit_lens.dtype, pin_memory=commit_lens.is_cuda)
        host.copy_(commit_lens, non_blocking=True)
        self._pending.append(_PendingStep(host, block, started.stop()))
        while self._pending and self._pending[0].clock.done():
            step = self._pending.pop(0)
            drafts = [n - 1 for n in step.commit_lens.tolist()]
            self.step_counters.add_step(drafts, step.block, step.clock.seconds())


class _StepClock:
    """Device time of one step: CUDA events on the current stream (read once the
    end event completes), or wall time on other devices (synchronous there)."""

    def __init__(self, start: torch.cuda.Event | float) -> None:
        self.begin, self.end = start, None

    @classmethod
    def start(cls, device: torch.device | str) -> _StepClock:
        if torch.device(device).type != "cuda":
            return cls(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return cls(event)

    def stop(self) -> _StepClock:
        if isinstance(self.begin, float):
            self.end = time.perf_counter()
        else:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()
        return self

    def done(self) -> bool:
        return isinstance(self.end, float) or self.end.query()

    def seconds(self) -> float:
        if isinstance(self.begin, float):
            return self.end - self.begin
        return self.begin.elapsed_time(self.end) / 1e3  # milliseconds


class _PendingStep(NamedTuple):
    commit_lens: torch.Tensor
    block: int
    clock: _StepClock
