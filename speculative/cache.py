"""A KV cache that appends in place.

transformers' ``DynamicLayer`` appends by concatenating, which copies every
cached key and value at every step: O(T) memory traffic per token and layer.
On a CPU at batch 48 that copy took 75 % of a decode step of a 30-layer model.
``GrowingLayer`` keeps spare capacity instead (a quarter more when full),
writes the new slots into it, and hands attention a view of the used part. Anything that
replaces a layer's tensors (``RaggedBatch`` compaction, merging, row selection)
assigns ``keys``/``values`` as before. An assigned tensor the buffer can hold
(same rows, not far fewer slots: a compaction, every few rounds) is copied into
it; anything else is kept as it is and the next append reallocates with room.
Reusing the buffer matters on a CPU: a compaction once freed 60 buffers of a
30-layer model and the next append allocated 60 new ones of twice the size,
and glibc's heap fragmented under the churn (a 16-row load's RSS reached
9 GB with 0.8 GB of caches, docs/LOG.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64
"""Slots allocated at least when a layer grows."""

HEADROOM = 0.25
"""Spare slots a layer allocates when it grows, as a share of those it holds.
Doubling left up to half of every buffer empty, so a batch's caches could take
twice what ``--max-batch-slots`` counts; a quarter more still regrows a
1,500-slot row only every ~100 rounds, each a copy of its caches."""

MAX_SPARE_RATIO = 4
"""An assigned tensor is copied into the buffer only while the buffer holds at
most this many times its slots: past that (a long row left) the buffer goes,
so that memory comes back."""


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' CacheLayerMixin.__init_subclass__ is unannotated
    """A ``DynamicLayer`` whose ``update`` writes into spare capacity."""

    def __init__(self, **kwargs: Any) -> None:
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._used = {"keys": 0, "values": 0}  # kept apart: callers assign keys and values one at a time
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # transformers' CacheLayerMixin.__init__ is unannotated

    @property
    def keys(self) -> torch.Tensor | None:
        """Cached keys [B, kvh, used slots, d] (a view of the buffer)."""
        return None if self._keys is None else self._keys[:, :, : self._used["keys"]]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys = _kept(self._keys, tensor)
        self._used["keys"] = _slots(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        """Cached values [B, kvh, used slots, d] (a view of the buffer)."""
        return None if self._values is None else self._values[:, :, : self._used["values"]]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = _kept(self._values, tensor)
        self._used["values"] = _slots(tensor)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` [B, kvh, n, d]; returns all cached keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used, new = self._used["keys"], key_states.shape[-2]
        if self._used["values"] != used:
            raise RuntimeError(f"cache layer holds {used} keys but {self._used['values']} values")
        keys, values = self._keys, self._values
        assert keys is not None and values is not None  # lazy_initialization assigned both
        if keys.dim() < 4 or values.dim() < 4 or used + new > min(keys.shape[-2], values.shape[-2]):
            capacity = max(MIN_CAPACITY, math.ceil((used + new) * (1 + HEADROOM)))
            self._keys = keys = _grown(keys, key_states, used, capacity)
            self._values = values = _grown(values, value_states, used, capacity)
        keys[:, :, used : used + new] = key_states
        values[:, :, used : used + new] = value_states
        self._used = {"keys": used + new, "values": used + new}
        return keys[:, :, : used + new], values[:, :, : used + new]


def _slots(tensor: torch.Tensor | None) -> int:
    """Slots a tensor assigned to a layer holds (0 for the empty placeholder)."""
    return 0 if tensor is None or tensor.dim() < 3 else tensor.shape[-2]


def _kept(buffer: torch.Tensor | None, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """What a layer keeps when ``tensor`` is assigned over ``buffer``: the
    buffer, holding the tensor in its first slots, where it fits (same rows,
    heads, head size, dtype and device; at least the tensor's slots and at most
    ``MAX_SPARE_RATIO`` times them; writable here); else the tensor itself."""
    if buffer is None or tensor is None or buffer.dim() < 4 or tensor.dim() < 4:
        return tensor
    slots, capacity = tensor.shape[-2], buffer.shape[-2]
    fits = (
        tensor.shape[:2] == buffer.shape[:2]
        and tensor.shape[-1] == buffer.shape[-1]
        and tensor.dtype == buffer.dtype
        and tensor.device == buffer.device
        and slots <= capacity <= MAX_SPARE_RATIO * max(slots, MIN_CAPACITY)
    )
    # An inference tensor (allocated under ``torch.inference_mode``) cannot be written outside it.
    if not fits or (buffer.is_inference() and not torch.is_inference_mode_enabled()):
        return tensor
    if tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride():
        return buffer  # the buffer's own first slots (a truncation): nothing to copy
    if tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
        return tensor  # another view of the buffer: copying would overwrite what it reads
    buffer[:, :, :slots].copy_(tensor)
    return buffer


def _grown(buffer: torch.Tensor, like: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    """A [B, kvh, capacity, d] buffer holding ``buffer``'s first ``used`` slots."""
    grown = like.new_empty(*like.shape[:2], capacity, like.shape[-1])
    if used:
        grown[:, :, :used] = buffer[:, :, :used]
    return grown


def growing_cache() -> DynamicCache:
    """An empty cache whose layers are ``GrowingLayer``s."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache
