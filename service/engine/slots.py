"""The batch's cache-slot budget (``--max-batch-slots``) as two pure rules.

The native engine's caches are padded to the batch's longest row, so a batch
holds rows x longest-row slots. Admission asks ``fits`` with the waiting
request's row added; before every round the engine asks ``preempted`` how many
of the latest admitted rows must leave, because rows grow as they decode.
Both ask whether the batch still fits after one more round of the largest
block, so a preempted row waits until a row has left rather than one round.
"""

from __future__ import annotations

from collections.abc import Sequence


def fits(widths: Sequence[int], budget: int, growth: int) -> bool:
    """Whether rows holding ``widths`` cache slots, padded to the longest, stay
    within ``budget`` slots after each grows by ``growth``. A lone row always
    fits (it must be able to run); ``budget`` 0: no limit."""
    return not budget or len(widths) <= 1 or len(widths) * (max(widths) + growth) <= budget


def preempted(widths: Sequence[int], budget: int, growth: int) -> int:
    """How many rows must leave from the end of ``widths`` (rows in admission
    order) for the rest to ``fit``; never the first, so the batch always moves."""
    kept = len(widths)
    while kept > 1 and not fits(widths[:kept], budget, growth):
        kept -= 1
    return len(widths) - kept
