"""The native engine's settings (``NativeEngineConfig``) and how many CPU
threads it decodes with."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from service.engine.types import BlockPolicy
from speculative.session import DEFAULT_COMPACT_SLACK, Proposal


@dataclass(frozen=True)
class NativeEngineConfig:
    """Scheduler settings: rows decoded together at most, requests waiting at most,
    the initial block-size policy (None: the draft's trained block at every batch
    size), cache compaction slack (slots), draft proposals.
    ``plain_reference_every`` N: every N-th drafting step of an all-greedy batch
    runs as plain decoding (b = 1) instead, so the achieved speedup compares
    against plain steps timed at the same moment, batch and contexts (a start-up
    profile runs short random prompts on an idle process: on the bundled pair
    its plain steps took 7 ms against 16 ms served). Greedy output is the same
    under any blocks; a sampled row's draws are not, so a batch with one runs no
    reference step and every request decodes what it decodes alone; 0: never.
    ``threads``: intra-op threads of the scheduler thread's torch ops (0: leave
    torch's setting; ``decode_threads`` picks the service's default).
    ``branches``: candidates verified for the first drafted slot
    (``DecodeSession``; 1: the draft's chain alone). ``lookup``: n-gram
    lookup tokens verified beside the draft (``DecodeSession``; 0: none),
    continued from the draft's n-gram table with ``lookup_table``.
    ``prefill_chunk``: a prompt longer than this many tokens is prefilled
    that many at a time, one chunk between two steps, so it stalls the
    running streams for a chunk at a time (0: whole prompts).
    ``max_batch_slots``: the batch's caches are padded to its longest row, so
    they hold rows x longest-row slots; a waiting request is admitted only
    while that, with it, stays within this many (a lone request always is; 0:
    no limit). Sixteen rows beside one of 7,800 tokens peaked at 7.4 GB on
    SmolLM2 (docs/LOG.md), past the CPU pod's 4 GiB limit: one long request
    would have had every request killed with the pod. Rows grow as they
    decode: before each round, while the batch would pass the budget after
    it, the latest admitted row is preempted (``NativeEngine._make_room``).
    ``release_memory_after_s``: once the engine has sat idle that long after
    work, the C heap's freed pages go back to the OS (``service.engine.heap``);
    0: never."""

    max_batch_size: int = 16
    max_waiting: int = 64
    policy: BlockPolicy | None = None
    compact_slack: int = DEFAULT_COMPACT_SLACK
    proposal: Proposal = "sample"
    plain_reference_every: int = 64
    threads: int = 0
    branches: int = 1
    lookup: int = 0
    lookup_table: bool = True
    prefill_chunk: int = 256
    max_batch_slots: int = 0
    release_memory_after_s: float = 0.0

    def __post_init__(self) -> None:
        counts = (
            self.max_waiting,
            self.plain_reference_every,
            self.threads,
            self.lookup,
            self.prefill_chunk,
            self.max_batch_slots,
        )
        if min(self.max_batch_size, self.branches) < 1 or min(counts) < 0:
            raise ValueError(
                "max_batch_size and branches must be >= 1, max_waiting, plain_reference_every, threads, lookup "
                "prefill_chunk and max_batch_slots >= 0"
            )


def decode_threads(requested: int, cpus: int) -> int:
    """Intra-op threads for decoding: ``requested``, or for 0 the usable
    ``cpus`` less one, at least one. The event loop (HTTP, SSE, /metrics) needs a core
    of its own: on the 2-core dev VM, torch's default of two OpenMP threads
    beside it halved a plain fp32 server's throughput (15.0 against 28.8
    tokens/s with one thread, docs/LOG.md), because a decode step is hundreds
    of short parallel regions and each waits for a thread the event loop holds
    off its core."""
    return requested or max(1, cpus - 1)


def usable_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may run on: its affinity mask (a cpuset), capped by a
    cgroup v2 CPU quota (a container's CPU limit: ``"200000 100000"`` is 2
    CPUs, rounded up), which the affinity mask does not show."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()
    except (OSError, ValueError):  # no cgroup v2 CPU controller here: the affinity mask is all there is
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))
