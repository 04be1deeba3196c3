"""Ragged batch state: the target cache and the draft's context cache, slot-aligned.

Rows of one batch accept different numbers of drafted tokens each round, so no
cache can simply be cropped to one length. Every verify forward appends ``b``
slots per row to both caches; ``slot_positions`` [B, T] records the absolute
position held by each slot, -1 for slots to ignore (left padding of the
prompt, drafted tokens the target rejected). Masks are built from it
(``speculative.masks``), and ``compact`` squeezes the ignored slots out once
they waste enough room.

The draft cache holds, slot for slot, the context K/V of the token the target
cache holds in the same slot: both are filled from the same target forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache


class _KVLayer(Protocol):
    """A filled attention layer of a cache: keys and values [B, kvh, T, d]."""

    keys: torch.Tensor
    values: torch.Tensor


def _layers(cache: DynamicCache) -> list[_KVLayer]:
    """``cache``'s layers. These caches start empty and get one attention layer
    (``DynamicLayer`` or ``GrowingLayer``) per decoder layer on its first update,
    so every layer holds tensors; transformers types them as possibly empty."""
    return cast(list[_KVLayer], cache.layers)


@dataclass
class RaggedBatch:
    """Caches and slot layout of the rows being decoded together."""

    slot_positions: torch.Tensor
    target_cache: DynamicCache
    draft_cache: DynamicCache | None

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row (prompt + accepted), [B]."""
        return (self.slot_positions >= 0).sum(dim=1)

    @property
    def num_slots(self) -> int:
        """Cache columns (T), committed or not."""
        return int(self.slot_positions.shape[1])

    def commit(self, new_positions: torch.Tensor) -> None:
        """Record the slots the last forward appended: ``new_positions`` [B, n]
        with -1 where the token was rejected."""
        self.slot_positions = torch.cat([self.slot_positions, new_positions], dim=1)

    def wasted_slots(self) -> int:
        """Slots beyond the longest row's committed tokens."""
        return self.num_slots - int(self.lengths.max())

    def compact(self) -> None:
        """Move every row's committed slots to the right end, in order, and drop
        the columns no row needs any more (one gather over every cache layer)."""
        valid = self.slot_positions >= 0
        keep = int(valid.sum(dim=1).max())
        # Stable sort of the validity flags: ignored slots first, committed slots
        # after them, each group in its original order.
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, self.num_slots - keep :]
        self.slot_positions = self.slot_positions.gather(1, order)
        for cache in self._caches():
            for layer in _layers(cache):
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
                layer.keys = layer.keys.gather(2, index)
                layer.values = layer.values.gather(2, index.expand(-1, -1, -1, layer.values.shape[-1]))

    def merge(self, other: RaggedBatch) -> None:
        """Append ``other``'s rows (same models) after this batch's rows; the
        shorter side is left-padded with ignored slots so columns line up."""
        width = max(self.num_slots, other.num_slots)
        for side in (self, other):
            pad = width - side.num_slots
            if pad:
                side.slot_positions = F.pad(side.slot_positions, (pad, 0), value=-1)
                for cache in side._caches():
                    for layer in _layers(cache):
                        layer.keys = F.pad(layer.keys, (0, 0, pad, 0))
                        layer.values = F.pad(layer.values, (0, 0, pad, 0))
        self.slot_positions = torch.cat([self.slot_positions, other.slot_positions])
        for mine, theirs in zip(self._caches(), other._caches(), strict=True):
            for a, b in zip(_layers(mine), _layers(theirs), strict=True):
                a.keys = torch.cat([a.keys, b.keys])
                a.values = torch.cat([a.values, b.values])

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the batch), freeing the others' caches."""
        self.slot_positions = self.slot_positions[rows]
        for cache in self._caches():
            for layer in _layers(cache):
                layer.keys = layer.keys[rows]
                layer.values = layer.values[rows]

    def truncate(self, num_slots: int) -> None:
        """Drop the cache columns from ``num_slots`` on (undo appends not kept)."""
        self.slot_positions = self.slot_positions[:, :num_slots]
        for cache in self._caches():
            for layer in _layers(cache):
                layer.keys = layer.keys[:, :, :num_slots]
                layer.values = layer.values[:, :, :num_slots]

    def _caches(self) -> list[DynamicCache]:
        return [c for c in (self.target_cache, self.draft_cache) if c is not None]


def append_draft_context(cache: DynamicCache, context: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append per-layer context (k, v) [B, kvh, n, d] to the draft cache."""
    for layer_idx, (k, v) in enumerate(context):
        cache.update(k, v, layer_idx)


def draft_context(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer cached context (k, v) of the draft."""
    return [(layer.keys, layer.values) for layer in _layers(cache)]


PREFILL_FORWARD_TOKENS = 128
"""What one more prefill forward costs, in prompt tokens: on SmolLM2 (bf16, 2
cores) a forward costs about 35 ms plus 0.25 ms a token (rows x padded width),
so three 16-token prompts beside a 256-token one took 302 ms in one forward
against 161 ms in two (docs/LOG.md)."""


def prefill_groups(lengths: Sequence[int], forward_tokens: int = PREFILL_FORWARD_TOKENS) -> list[list[int]]:
    """Split prompts of ``lengths`` tokens, admitted together, into prefill
    forwards: indices grouped by length, shortest first, so that no short
    prompt is padded to a long one's width where a forward of its own costs
    less (``forward_tokens`` per forward; each forward costs rows x its longest
    prompt). Shortest first: the short prompts' first tokens come out before
    the long prompt's forward instead of after it. One group when lengths are
    alike. Dynamic programming over the sorted lengths."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lengths = [lengths[i] for i in order]
    # best[j]: cheapest split of the j shortest; cut[j]: where its last group starts.
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for stop in range(1, len(order) + 1):
        for start in range(stop):
            cost = best[start] + (stop - start) * sorted_lengths[stop - 1] + forward_tokens
            if cost < best[stop]:
                best[stop], cut[stop] = cost, start
    groups, stop = [], len(order)
    while stop:
        groups.append(order[cut[stop] : stop])
        stop = cut[stop]
    return groups[::-1]
