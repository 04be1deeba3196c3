"""The plugin's logic that does not need SGLang: algorithm names, the per-step
block size, per-block-size worker state and CUDA graph sets, and acceptance and
step-time accounting.

Everything here runs (and is tested) on CPU; ``worker.py`` and ``plugin.py``
apply it inside SGLang's scheduler processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from speculative.policy import CANDIDATE_BLOCK_SIZES, BlockPolicy, Turns

ADAPTIVE_ALGORITHM = "DFLASH_ADAPTIVE"
UPSTREAM_ALGORITHM = "DFLASH"
ADAPTIVE_ENV = "DFLASH_SERVE_ADAPTIVE"
"""Set to "1" in the launching process (inherited by the spawned schedulers):
the DFlash worker becomes ``AdaptiveDFlashWorker``."""

GRAPH_BLOCKS_ENV = "DFLASH_SERVE_GRAPH_BLOCKS"
"""Comma-separated block sizes that get their own CUDA graphs (the trained
block always has them); unset or empty: every controller candidate up to the
trained block. Each set costs GPU memory and capture time at start-up."""

PLAIN_STEPS_ENV = "DFLASH_SERVE_PLAIN_STEPS"
"""Set to "1": a decode step whose policy block is 1 runs as plain decoding (the
target verifies the anchor alone and the draft forward is skipped; the
committed token's features still reach the draft's context). Otherwise b = 1
runs as b = 2, the smallest block upstream's worker drafts for. Off by default
until a GPU run of ``deploy/gpu/smoke.sh`` has checked it."""

DRAFTING_MIN_BLOCK_SIZE = 2
"""The smallest block that drafts anything (one proposed token)."""


def smallest_block_size(plain_steps: str | None, argmax_draft: bool) -> int:
    """The smallest block the worker verifies: 1 when plain steps are on
    (``PLAIN_STEPS_ENV`` = "1") and the draft proposes by argmax over its
    hidden states (the path a skipped draft forward stubs; selector, LiLiCorr
    and Domino drafts read more of it), else ``DRAFTING_MIN_BLOCK_SIZE``."""
    return 1 if plain_steps == "1" and argmax_draft else DRAFTING_MIN_BLOCK_SIZE


# Worker attributes whose shape or content depends on the block size. The
# upstream worker sizes them once from ``block_size``; the adaptive worker keeps
# one set per block size and swaps them in before a step.
BLOCK_STATE_ATTRS = (
    "block_size",
    "speculative_num_draft_tokens",
    "_block_pos_offsets",
    "_draft_block_spec_info",
    # [capacity, block] draft buffers; reallocated when the ids buffer is None.
    "_draft_block_ids_buf",
    "_draft_block_positions_buf",
    "_draft_block_tokens_buf",
    "_draft_verify_out_cache_loc_buf",
    "_draft_block_end_buf",
    "_draft_seq_lens_cpu_buf",
    # double-buffered accept outputs ([capacity, block] tokens); reallocated when the cap is 0.
    "_accept_bonus_buffer_cap",
    "_accept_len_buf",
    "_commit_lens_bufs",
    "_bonus_id_bufs",
    "_out_tokens_bufs",
    "_new_seq_lens_bufs",
)


def resolve_algorithm(name: str | None) -> tuple[str | None, bool]:
    """``--speculative-algorithm`` as given -> (the name SGLang resolves, adaptive?).
    ``DFLASH_ADAPTIVE`` runs as upstream ``DFLASH`` (so every upstream DFlash
    check and code path applies) with the adaptive worker."""
    if name is not None and name.upper() == ADAPTIVE_ALGORITHM:
        return UPSTREAM_ALGORITHM, True
    return name, False


def step_block_size(
    policy: BlockPolicy,
    batch_size: int,
    trained_block_size: int,
    turns: Turns,
    smallest: int = DRAFTING_MIN_BLOCK_SIZE,
) -> int:
    """The block to verify this step: the policy's entry for the batch size
    (taking ``turns`` with its alternate, if any), within [``smallest``,
    trained_block_size]."""
    return max(smallest, min(turns.block_size(policy, max(1, batch_size)), trained_block_size))


def graph_block_sizes(
    value: str | None, trained_block_size: int, smallest: int = DRAFTING_MIN_BLOCK_SIZE
) -> tuple[int, ...]:
    """The block sizes to capture CUDA graphs for (``GRAPH_BLOCKS_ENV``'s value),
    the trained block included; ``smallest``: the smallest block the worker runs.
    ValueError on a size the worker never runs."""
    if not value or not value.strip():
        blocks = {max(smallest, b) for b in CANDIDATE_BLOCK_SIZES if b <= trained_block_size}
    else:
        try:
            blocks = {int(part) for part in value.split(",")}
        except ValueError:
            raise ValueError(f"{GRAPH_BLOCKS_ENV} must be comma-separated integers, got {value!r}") from None
        wrong = sorted(b for b in blocks if not smallest <= b <= trained_block_size)
        if wrong:
            raise ValueError(
                f"{GRAPH_BLOCKS_ENV}: block sizes {wrong} outside [{smallest}, {trained_block_size}] "
                "(the smallest block the worker runs, the draft's block)"
            )
    return tuple(sorted(blocks | {trained_block_size}))


@dataclass(frozen=True)
class BlockRuntime:
    """What a decode step at one block size runs on: the target's and the
    draft's attention backends and graph runners (captured at that width) and
    the draft sampler folded into the draft graph (None: argmax runs eagerly).
    One set per block size, swapped in before a step, as SGLang's adaptive
    EAGLE keeps one runtime state per step count.

    The fields are SGLang objects, typed ``Any`` on purpose: SGLang is not
    importable where this module is type-checked (nor needed to run it)."""

    target_attn_backend: Any
    target_graph_runner: Any  # None without graphs
    draft_attn_backend: Any
    draft_graph_runner: Any  # None without graphs
    draft_sampler: Any | None


class BlockStateCache:
    """One set of ``BLOCK_STATE_ATTRS`` per block size on ``worker``.

    ``activate(b)`` saves the current set under the active block size and
    restores b's set, building it with ``fresh(b)`` the first time (attribute
    values that make the upstream worker allocate its buffers lazily at the new
    width). Buffers of other block sizes stay alive, so results of an earlier
    step still being read (overlap scheduling) are never overwritten.
    """

    def __init__(self, worker: Any, fresh: Callable[[int], dict[str, object]]) -> None:
        # ``worker``: SGLang's DFlash worker (Any: SGLang is not importable here).
        self.worker, self.fresh = worker, fresh
        self.active = int(worker.block_size)
        self.saved: dict[int, dict[str, object]] = {}

    def activate(self, block_size: int) -> bool:
        """Make ``block_size`` current; True when it changed."""
        if block_size == self.active:
            return False
        self.saved[self.active] = {name: getattr(self.worker, name) for name in BLOCK_STATE_ATTRS}
        state = self.saved.pop(block_size, None) or self.fresh(block_size)
        missing = set(BLOCK_STATE_ATTRS) - set(state)
        if missing:
            raise ValueError(f"state for block {block_size} lacks {sorted(missing)}")
        for name, value in state.items():
            setattr(self.worker, name, value)
        self.active = block_size
        return True


@dataclass
class StepCell:
    """Cumulative verify steps of one (batch size, block size): how many, how
    many replayed the target's CUDA graph, their device seconds, and accepted
    drafts per block position (slot k + 1)."""

    steps: int = 0
    seconds: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    graph_steps: int = 0

    def add(self, steps: int, seconds: float, accepted_per_position: Sequence[int], graph_steps: int = 0) -> None:
        self.steps += steps
        self.graph_steps += graph_steps
        self.seconds += seconds
        self.accepted_per_position = [
            a + b for a, b in zip(self.accepted_per_position, accepted_per_position, strict=True)
        ]


@dataclass
class StepCounters:
    """Every verify step by (batch size, block size): the data behind the native
    engine's step metrics (step-time histogram, per-position acceptance), kept
    cumulative in the scheduler and read by the service (``get_internal_state``)."""

    cells: dict[tuple[int, int], StepCell] = field(default_factory=dict)

    def cell(self, batch_size: int, block_size: int) -> StepCell:
        key = (batch_size, block_size)
        if key not in self.cells:
            self.cells[key] = StepCell(accepted_per_position=[0] * (block_size - 1))
        return self.cells[key]

    def add_step(self, accept_lengths: Sequence[int], block_size: int, seconds: float, graph: bool = False) -> None:
        """Fold one step: ``accept_lengths[i]`` drafts of row i accepted (0 .. b - 1);
        ``graph``: the target verified by replaying a CUDA graph."""
        if any(not 0 <= n < block_size for n in accept_lengths):
            raise ValueError(f"accept lengths {list(accept_lengths)} outside 0..{block_size - 1}")
        per_position = [sum(n > k for n in accept_lengths) for k in range(block_size - 1)]
        self.cell(len(accept_lengths), block_size).add(1, seconds, per_position, int(graph))

    def to_report(self) -> list[dict[str, Any]]:
        """JSON-ready rows (SGLang ships internal state as builtins)."""
        return [
            {
                "batch_size": batch,
                "block_size": b,
                "steps": c.steps,
                "graph_steps": c.graph_steps,
                "seconds": c.seconds,
                "accepted_per_position": list(c.accepted_per_position),
            }
            for (batch, b), c in sorted(self.cells.items())
        ]

    @classmethod
    def from_reports(cls, reports: Sequence[Sequence[dict[str, Any]]]) -> StepCounters:
        """The sum of several schedulers' reports (data-parallel ranks batch separately)."""
        total = cls()
        for report in reports:
            for row in report:
                cell = total.cell(int(row["batch_size"]), int(row["block_size"]))
                accepted = [int(n) for n in row["accepted_per_position"]]
                cell.add(int(row["steps"]), float(row["seconds"]), accepted, int(row["graph_steps"]))
        return total

    def since(self, earlier: StepCounters) -> StepCounters:
        """What happened after ``earlier`` (a cell that shrank restarted: taken whole)."""
        delta = StepCounters()
        for key, cell in self.cells.items():
            before = earlier.cells.get(key)
            if before is None or cell.steps < before.steps:
                before = StepCell(accepted_per_position=[0] * len(cell.accepted_per_position))
            if cell.steps > before.steps:
                accepted = zip(cell.accepted_per_position, before.accepted_per_position, strict=True)
                delta.cells[key] = StepCell(
                    cell.steps - before.steps,
                    cell.seconds - before.seconds,
                    [now - then for now, then in accepted],
                    cell.graph_steps - before.graph_steps,
                )
        return delta


@dataclass(frozen=True)
class AcceptCounters:
    """Per-position acceptance over all steps, correct when b changes between
    steps: a position is "verified" only in rows whose block had that position."""

    steps: int
    rows: int
    drafted: int
    accepted: int
    accepted_per_position: list[int]
    verified_per_position: list[int]

    @classmethod
    def from_steps(cls, counters: StepCounters, max_block_size: int) -> AcceptCounters:
        """Totals of ``counters`` over every (batch size, b) cell."""
        accepted_per_position = [0] * (max_block_size - 1)
        verified_per_position = [0] * (max_block_size - 1)
        steps = rows = drafted = 0
        for (batch, b), cell in counters.cells.items():
            steps += cell.steps
            rows += cell.steps * batch
            drafted += cell.steps * batch * (b - 1)
            for k, accepted in enumerate(cell.accepted_per_position):
                accepted_per_position[k] += accepted
                verified_per_position[k] += cell.steps * batch
        return cls(steps, rows, drafted, sum(accepted_per_position), accepted_per_position, verified_per_position)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per row-step (accepted drafts + the bonus token)."""
        return (self.accepted + self.rows) / self.rows if self.rows else 0.0
