"""DFlash draft configuration: parse official checkpoint configs and check them
against a target.

An official DFlash ``config.json`` is a copy of the target's Qwen3 config with
``num_hidden_layers`` set to the draft depth, plus ``block_size`` (top level in v1;
newer checkpoints put it in ``dflash_config``), ``num_target_layers`` and a
``dflash_config`` dict with ``mask_token_id`` and ``target_layer_ids``. This
project's drafts may add ``dflash_config.draft_vocab_size``: the draft proposes
only from that many target tokens, listed in the checkpoint's ``draft_vocab_ids``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import torch
from transformers import Qwen3Config

DEFAULT_BLOCK_SIZE = 16
ATTENTION_TYPES = ("full_attention", "sliding_attention")


class DraftConfigError(ValueError):
    """A draft config that cannot be used as written (bad or missing keys)."""


class DraftTargetMismatch(ValueError):
    """A draft that does not fit the target it is paired with."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Official fallback for ``target_layer_ids``: spread the draft's feature layers
    evenly over ``[1, L - 3]``; one draft layer reads the middle layer.

    Uses Python's ``round`` (banker's rounding) exactly as the reference code does,
    so 36 target layers and 5 draft layers give ``[1, 9, 17, 25, 33]``.
    """
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise DraftConfigError(
            f"layer counts must be positive, got num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise DraftConfigError(f"the default target_layer_ids need at least 4 target layers, got {num_target_layers}")
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class LayerAttention:
    """How one draft layer attends: causal or not, and an optional sliding window
    (Hugging Face convention: a key is visible when ``q_pos - k_pos < window``)."""

    causal: bool
    window: int | None


@dataclass(frozen=True)
class DFlashConfig:
    """Parsed, validated DFlash draft config.

    ``architecture`` is the Qwen3 config of the draft layers (sizes, RoPE);
    ``raw`` is the dict as read, written back unchanged on save.
    ``draft_vocab_size`` is None for a draft that proposes from the whole
    target vocabulary (every official draft), else the size K of its reduced
    draft vocabulary.
    """

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_attention: tuple[LayerAttention, ...]
    input_embedding_scale: float
    draft_vocab_size: int | None
    architecture: Qwen3Config = field(repr=False, compare=False)
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        """Draft decoder layers."""
        return len(self.layer_attention)

    @property
    def hidden_size(self) -> int:
        """Hidden size, which must equal the target's."""
        return int(self.architecture.hidden_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Parse an official DFlash config dict; raise ``DraftConfigError`` on bad keys."""
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DraftConfigError("dflash_config must be a JSON object")
        num_layers = _positive_int(raw, "num_hidden_layers")
        num_target_layers = _positive_int(raw, "num_target_layers")

        block_size = dflash.get("block_size", raw.get("block_size", DEFAULT_BLOCK_SIZE))
        if not _is_int(block_size) or block_size < 2:
            raise DraftConfigError(f"block_size must be an integer >= 2, got {block_size!r}")

        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if not _is_int(mask_token_id) or mask_token_id < 0:
            raise DraftConfigError(f"dflash_config.mask_token_id must be a non-negative integer, got {mask_token_id!r}")

        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if layer_ids is None:
            layer_ids = build_target_layer_ids(num_target_layers, num_layers)
        if not isinstance(layer_ids, list) or not layer_ids or not all(map(_is_int, layer_ids)):
            raise DraftConfigError(f"target_layer_ids must be a non-empty list of integers, got {layer_ids!r}")
        out_of_range = [i for i in layer_ids if not 0 <= i < num_target_layers]
        if out_of_range:
            raise DraftConfigError(
                f"target_layer_ids {out_of_range} are outside the target's "
                f"{num_target_layers} layers (valid ids: 0..{num_target_layers - 1})"
            )

        scale = dflash.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise DraftConfigError(f"input_embedding_scale must be a positive number, got {scale!r}")

        layer_attention = _layer_attention(raw, dflash, num_layers)  # before transformers' own layer_types check
        architecture = _architecture(raw)
        draft_vocab_size = dflash.get("draft_vocab_size")
        vocab_size = int(architecture.vocab_size)
        if draft_vocab_size is not None and (not _is_int(draft_vocab_size) or not 0 < draft_vocab_size <= vocab_size):
            raise DraftConfigError(
                f"dflash_config.draft_vocab_size must be an integer in [1, vocab_size={vocab_size}], "
                f"got {draft_vocab_size!r}"
            )

        return cls(
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=num_target_layers,
            layer_attention=layer_attention,
            input_embedding_scale=float(scale),
            draft_vocab_size=draft_vocab_size,
            architecture=architecture,
            raw=dict(raw),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DFlashConfig:
        """Read ``config.json`` (or a directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise DraftConfigError(f"no draft config at {path}") from exc
        except json.JSONDecodeError as exc:
            raise DraftConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def with_draft_vocab_size(self, size: int | None) -> DFlashConfig:
        """This config with ``dflash_config.draft_vocab_size`` set to ``size``
        (None: the whole target vocabulary, and the key is dropped)."""
        raw = dict(self.raw)
        dflash = {k: v for k, v in (raw.get("dflash_config") or {}).items() if k != "draft_vocab_size"}
        if size is not None:
            dflash["draft_vocab_size"] = size
        raw["dflash_config"] = dflash
        return DFlashConfig.from_dict(raw)

    def check_target(
        self,
        *,
        hidden_size: int,
        num_layers: int,
        embedding_rows: int,
        vocab_size: int,
        draft_vocab_ids: torch.Tensor | None = None,
    ) -> None:
        """Raise ``DraftTargetMismatch`` when this draft cannot serve a target of
        this shape. ``draft_vocab_ids`` is the draft's reduced vocabulary, when it
        has one: each id names a row of the target's LM head, so all must lie in
        the target's vocabulary."""
        problems = []
        if hidden_size != self.hidden_size:
            problems.append(f"hidden size: draft {self.hidden_size}, target {hidden_size}")
        if num_layers != self.num_target_layers:
            problems.append(
                f"layer count: draft was built for {self.num_target_layers} target layers, target has {num_layers}"
            )
        bad_ids = [i for i in self.target_layer_ids if i >= num_layers]
        if bad_ids:
            problems.append(f"target_layer_ids {bad_ids} out of range for {num_layers} target layers")
        draft_vocab = int(self.architecture.vocab_size)
        if draft_vocab != vocab_size:
            problems.append(f"vocabulary: draft {draft_vocab}, target {vocab_size}")
        if self.mask_token_id >= embedding_rows:
            problems.append(
                f"mask_token_id {self.mask_token_id} is outside the target's embedding table ({embedding_rows} rows)"
            )
        problems += self._draft_vocab_problems(draft_vocab_ids, vocab_size)
        if problems:
            raise DraftTargetMismatch("draft does not fit the target: " + "; ".join(problems))

    def _draft_vocab_problems(self, ids: torch.Tensor | None, vocab_size: int) -> list[str]:
        """What is wrong with ``ids`` as this draft's map for a target of ``vocab_size`` tokens."""
        size = None if ids is None else ids.numel()
        if size != self.draft_vocab_size:
            return [f"draft vocabulary: the config declares {self.draft_vocab_size} ids, the map has {size}"]
        if ids is not None and int(ids.max()) >= vocab_size:
            return [f"draft_vocab_ids has id {int(ids.max())}, outside the target's vocabulary of {vocab_size} tokens"]
        return []


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not _is_int(value) or value <= 0:
        raise DraftConfigError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _layer_attention(raw: dict[str, Any], dflash: dict[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """Per-layer causality and window, as SGLang reads them: full-attention layers
    are bidirectional and sliding layers causal unless ``is_causal`` (or
    ``dflash_config.causal``) says otherwise."""
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers or any(t not in ATTENTION_TYPES for t in layer_types):
        raise DraftConfigError(
            f"layer_types must list one of {ATTENTION_TYPES} per draft layer ({num_layers}), got {layer_types!r}"
        )
    explicit_causal = raw.get("is_causal", dflash.get("causal"))
    window = raw.get("sliding_window") or dflash.get("swa_window_size")
    layers = []
    for layer_type in layer_types:
        if layer_type == "full_attention":
            causal = bool(explicit_causal) if explicit_causal is not None else False
            layers.append(LayerAttention(causal=causal, window=None))
            continue
        if not _is_int(window) or window <= 0:
            raise DraftConfigError(f"sliding_attention layers need a positive sliding_window, got {window!r}")
        causal = bool(explicit_causal) if explicit_causal is not None else True
        layers.append(LayerAttention(causal=causal, window=int(window)))
    return tuple(layers)


def _architecture(raw: dict[str, Any]) -> Qwen3Config:
    """The draft layers' sizes and RoPE, read by transformers' own Qwen3 config so
    every RoPE scaling it knows is honoured."""
    keys = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")}
    try:
        return Qwen3Config(**keys)
    except (TypeError, ValueError) as exc:
        raise DraftConfigError(f"draft config is not a valid Qwen3 config: {exc}") from exc
