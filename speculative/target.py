"""Target adapter over a Hugging Face ``transformers`` causal LM.

It runs batched forwards with per-row positions and ready-made 4D masks, and
captures the hidden states the draft reads. Convention (official DFlash, and the
one vLLM had to fix): target layer id ``l`` means the OUTPUT of decoder layer
``l``, i.e. ``output_hidden_states[l + 1]`` of transformers (index 0 is the
embedding output). Outputs are captured with forward hooks on the selected
decoder layers, so they are never the final, post-norm state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from speculative.masks import additive_mask, attention_allowed


@dataclass
class TargetOutput:
    """Logits [B, q, V] and, when layers are captured, features [B, q, n*H]
    (the selected layers' outputs concatenated in ``target_layer_ids`` order)."""

    logits: torch.Tensor
    features: torch.Tensor | None


class TargetModel:
    """A causal LM from transformers (Qwen3, Llama, ...) prepared for DFlash."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config()
        self._layer_ids: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._layer_types = tuple(getattr(self.config, "layer_types", None) or ())
        self._sliding_window = getattr(self.config, "sliding_window", None)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> TargetModel:
        """Load a local transformers checkpoint (never downloads)."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        return cls(model.to(device))

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
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        """Longest sequence the target supports (max_position_embeddings)."""
        return int(self.config.max_position_embeddings)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The transformers decoder layers (Qwen3/Llama layout)."""
        return self.model.model.layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's (frozen, shared) input embedding."""
        return self.model.get_input_embeddings()(token_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's (frozen, shared) output projection."""
        return self.model.get_output_embeddings()(hidden)

    def capture_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Capture the outputs of these decoder layers on every forward."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside the target's {self.num_layers} layers")
        self._layer_ids = tuple(layer_ids)
        for layer_id in sorted(set(layer_ids)):
            self._hooks.append(self.decoder_layers[layer_id].register_forward_hook(self._capture_hook(layer_id)))

    def _capture_hook(self, layer_id: int):
        def hook(_module: nn.Module, _inputs: object, output: torch.Tensor | tuple) -> None:
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def new_cache(self) -> DynamicCache:
        """An empty cache with one plain growing layer per decoder layer (sliding
        windows are applied through masks, so slots stay aligned across layers)."""
        return DynamicCache()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        cache_positions: torch.Tensor,
        *,
        capture: bool = True,
    ) -> TargetOutput:
        """Append ``input_ids`` [B, q] at ``positions`` [B, q] (-1 = padding) to
        ``cache``, whose slots hold the tokens at ``cache_positions`` [B, T]
        (-1 = ignore). Causal within the new tokens; rejected or padded slots are
        hidden by the mask."""
        key_positions = torch.cat([cache_positions, positions], dim=1)
        allowed = attention_allowed(positions, key_positions, causal=True)
        mask: torch.Tensor | dict[str, torch.Tensor] = additive_mask(allowed, self.dtype)
        if "sliding_attention" in self._layer_types:
            sliding = attention_allowed(positions, key_positions, causal=True, window=self._sliding_window)
            mask = {"full_attention": mask, "sliding_attention": additive_mask(sliding, self.dtype)}
        self._captured.clear()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions.clamp(min=0),
            cache=cache,
            use_cache=True,
        )
        features = None
        if capture and self._layer_ids:
            features = torch.cat([self._captured[i] for i in self._layer_ids], dim=-1)
        self._captured.clear()
        return TargetOutput(logits=out.logits, features=features)
