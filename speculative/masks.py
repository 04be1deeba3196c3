"""Attention masks from per-row token positions.

Every cache slot carries the absolute position of the token it holds, or -1 when
it holds nothing useful (left padding, or a drafted token the target rejected).
Masks are built from positions alone, so rows of one batch may hold different
numbers of committed tokens in the same cache tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def attention_allowed(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean [B, q, K] mask, True where a query may attend to a key.

    ``query_positions`` [B, q], ``key_positions`` [B, K]; a key at position -1 is
    never visible to a real query. ``causal`` hides keys after the query;
    ``window`` hides keys with ``q_pos - k_pos >= window`` (Hugging Face sliding
    window convention). Padding queries (position -1) see the padding keys only,
    so no softmax row is empty.
    """
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    allowed = k >= 0
    if causal:
        allowed = allowed & (k <= q)
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed | ((q < 0) & (k < 0))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, q, K] boolean mask -> [B, 1, q, K] additive float mask (0 or dtype min),
    the form every transformers attention backend accepts as a ready 4D mask."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


SPAN_CALL_KEYS = 512
"""What one more attention call per layer costs, in key columns of one row: a
batch splits into spans only where the padded columns it skips outweigh the
extra calls. Measured on SmolLM2 on 2 cores (docs/LOG.md): at 128, mildly
ragged plain steps (rows of 100 and 900 tokens, alternating) ran 7-10 % slower
than one call; at 512 and 1,024 none was slower, and the gains held."""


@dataclass(frozen=True)
class RowSpan:
    """Batch rows ``start:stop``, whose real queries see no key column before ``first_key``."""

    start: int
    stop: int
    first_key: int


def row_spans(cache_positions: torch.Tensor, call_keys: int = SPAN_CALL_KEYS) -> tuple[RowSpan, ...] | None:
    """How to split a ragged batch's attention so that no row reads a long
    neighbour's padding: contiguous runs of rows, each attending from the
    first cached slot any of its rows holds a token in (``cache_positions``
    [B, T], -1 for ignored slots, which no real query sees). None when one
    call over every column is cheapest.

    The left padding of a short row beside a long one is masked, but attention
    still reads it: a batch of three 200-token rows and one of 1,800 decoded
    plainly at 49 ms a step against 31 ms for four short rows (docs/LOG.md).
    Only cached columns are cut, so a padding query keeps its own column and
    no softmax row is empty. The split minimises rows x cached columns read
    plus ``call_keys`` per span (dynamic programming over contiguous runs;
    the new block's columns cost every row alike). None off CPUs: on a GPU a
    padded column costs little against one more kernel launch per layer, and
    reading the starts would make the host wait for the device every forward."""
    keys = int(cache_positions.shape[1])
    if keys == 0 or cache_positions.device.type != "cpu":
        return None
    valid = cache_positions >= 0
    # The first valid slot (argmax finds the first True); a row with none reads no cached column.
    starts = torch.where(valid.any(dim=1), valid.to(torch.int8).argmax(dim=1), keys).tolist()
    lowest = min(starts)
    # Splitting row by row could save at most this many columns: not worth a call, so one span (or none).
    if sum(starts) - lowest * len(starts) < call_keys:
        return (RowSpan(0, len(starts), lowest),) if lowest else None
    # best[j]: cheapest cover of rows :j; cut[j]: where its last span starts.
    best, cut = [0.0] + [float("inf")] * len(starts), [0] * (len(starts) + 1)
    for stop in range(1, len(starts) + 1):
        first_key = keys
        for start in range(stop - 1, -1, -1):
            first_key = min(first_key, starts[start])
            cost = best[start] + (stop - start) * (keys - first_key) + call_keys
            if cost < best[stop]:
                best[stop], cut[stop] = cost, start
    spans, stop = [], len(starts)
    while stop:
        start = cut[stop]
        spans.append(RowSpan(start, stop, min(starts[start:stop])))
        stop = start
    return tuple(reversed(spans))


def by_spans(
    spans: tuple[RowSpan, ...] | None, batch: int, attend: Callable[[slice, int], torch.Tensor]
) -> torch.Tensor:
    """``attend(rows, first_key)`` for each span (one call over every row and
    column without spans), the outputs concatenated along the batch."""
    outputs = [attend(slice(span.start, span.stop), span.first_key) for span in spans or (RowSpan(0, batch, 0),)]
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
