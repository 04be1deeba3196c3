"""Target adapter over a Hugging Face ``transformers`` causal LM.

It runs batched forwards with per-row positions and ready-made 4D masks, and
captures the hidden states the draft reads. Convention (official DFlash, and the
one vLLM had to fix): target layer id ``l`` means the OUTPUT of decoder layer
``l``, i.e. ``output_hidden_states[l + 1]`` of transformers (index 0 is the
embedding output). Outputs are captured with forward hooks on the selected
decoder layers, so they are never the final, post-norm state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from speculative.attention import use_grouped_attention
from speculative.cache import growing_cache
from speculative.masks import additive_mask, attention_allowed, row_spans
from speculative.packed import pack_linears, packing_support


@dataclass
class TargetOutput:
    """Logits [B, q, V] and, when layers are captured, features [B, q, n*H]
    (the selected layers' outputs concatenated in ``target_layer_ids`` order)."""

    logits: torch.Tensor
    features: torch.Tensor | None


class TargetModel:
    """A causal LM from transformers (Qwen3, Llama, ...) prepared for DFlash."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model: PreTrainedModel = model.eval()  # type: ignore[no-untyped-call]  # transformers' eval is unannotated
        self.config = model.config.get_text_config()
        self._hooked: set[int] = set()
        self._hook_lock = threading.Lock()
        self._local = threading.local()  # captures are per thread: engines may share one target
        self._layer_types = tuple(getattr(self.config, "layer_types", None) or ())
        self._sliding_window = getattr(self.config, "sliding_window", None)
        self.packing = "not packed"
        # Verify blocks attend per K/V head instead of copying the cache to every query head.
        self.grouped_attention = use_grouped_attention(model)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        packed: bool = False,
    ) -> TargetModel:
        """Load a local transformers checkpoint (never downloads); ``packed``:
        pack its linear weights once where the device and dtype allow
        (``pack_linears``)."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        # functools.wraps types PreTrainedModel.to with its unbound ``self`` as the first argument.
        target = cls(model.to(device))  # type: ignore[arg-type]
        if packed:
            target.pack_linears()
        return target

    def pack_linears(self) -> str:
        """Pack every linear weight once for the CPU (``speculative.packed``:
        plain steps and verify blocks both run faster); where this device or
        dtype cannot, leave them. Returns what happened, for the log (also
        ``self.packing``)."""
        reason = packing_support(self.device, self.dtype)
        self.packing = f"not packed: {reason}" if reason else f"{pack_linears(self.model)} linears packed (oneDNN)"
        return self.packing

    @property
    def device(self) -> torch.device:
        """Device of the target's weights."""
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the target's weights."""
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        """Decoder layers of the target."""
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """Hidden size of the target."""
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the target's config declares."""
        return int(self.config.vocab_size)

    @property
    def embedding_rows(self) -> int:
        """Rows of the input embedding table (may exceed vocab_size)."""
        embedding = cast(nn.Embedding, self.model.get_input_embeddings())  # typed as a plain nn.Module
        return int(embedding.weight.shape[0])

    @property
    def context_length(self) -> int:
        """Longest sequence the target supports (max_position_embeddings)."""
        return int(self.config.max_position_embeddings)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The transformers decoder layers (Qwen3/Llama layout)."""
        layers: nn.ModuleList = self.model.model.layers
        return layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's (frozen, shared) input embedding."""
        embeddings: torch.Tensor = self.model.get_input_embeddings()(token_ids)
        return embeddings

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's (frozen, shared) output projection."""
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        logits: torch.Tensor = head(hidden)
        return logits

    def _ensure_hooks(self, layer_ids: tuple[int, ...]) -> None:
        """Hook the output of every decoder layer in ``layer_ids`` (once)."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside the target's {self.num_layers} layers")
        with self._hook_lock:
            for layer_id in set(layer_ids) - self._hooked:
                self.decoder_layers[layer_id].register_forward_hook(self._capture_hook(layer_id))
                self._hooked.add(layer_id)

    def _capture_hook(self, layer_id: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(_module: nn.Module, _inputs: tuple[Any, ...], output: torch.Tensor | tuple[Any, ...]) -> None:
            captured = getattr(self._local, "captured", None)
            if captured is not None:
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def new_cache(self, *, in_place: bool = False) -> DynamicCache:
        """An empty cache with one growing layer per decoder layer (sliding
        windows are applied through masks, so slots stay aligned across layers).
        ``in_place``: layers that append into spare capacity
        (``speculative.cache``) instead of concatenating the whole cache."""
        return growing_cache() if in_place else DynamicCache()

    @torch.no_grad()
    def forward_sequences(
        self, input_ids: torch.Tensor, *, feature_layers: tuple[int, ...] = (), logits: bool = True
    ) -> TargetOutput:
        """One forward over whole sequences [B, S] from position 0 on a fresh
        cache (kept by no one): training features, teacher-forced analyses.
        ``logits=False`` skips the LM head but for the last position (features
        only: the head over a large vocabulary costs as much as several layers)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.forward(
            input_ids,
            positions,
            self.new_cache(),
            positions[:, :0],
            feature_layers=feature_layers,
            logits_to_keep=0 if logits else 1,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        cache_positions: torch.Tensor,
        *,
        feature_layers: tuple[int, ...] = (),
        logits_to_keep: int = 0,
        block_visible: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Append ``input_ids`` [B, q] at ``positions`` [B, q] (-1 = padding) to
        ``cache``, whose slots hold the tokens at ``cache_positions`` [B, T]
        (-1 = ignore). Causal within the new tokens; rejected or padded slots are
        hidden by the mask. ``feature_layers``: decoder layers whose outputs to
        return, concatenated in that order, as ``features``. ``logits_to_keep``:
        logits of that many last positions only (0: all). ``block_visible``
        [q, q] bool: which new tokens each new token may see besides the
        position rule (a tree of candidates: a token sees its ancestors only)."""
        self._ensure_hooks(feature_layers)
        key_positions = torch.cat([cache_positions, positions], dim=1)

        def allowed(window: int | None = None) -> torch.Tensor:
            visible = attention_allowed(positions, key_positions, causal=True, window=window)
            if block_visible is not None:
                visible[:, :, cache_positions.shape[1] :] &= block_visible
            return visible

        full = additive_mask(allowed(), self.dtype)
        mask: torch.Tensor | dict[str, torch.Tensor] = full
        spans = row_spans(cache_positions) if self.grouped_attention else None
        if "sliding_attention" in self._layer_types:
            sliding = additive_mask(allowed(self._sliding_window), self.dtype)
            mask = {"full_attention": full, "sliding_attention": sliding}
        self._local.captured = {} if feature_layers else None
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions.clamp(min=0),
                cache=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **({"row_spans": spans} if spans is not None else {}),
            )
            captured = self._local.captured
        finally:
            self._local.captured = None
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        return TargetOutput(logits=out.logits, features=features)
