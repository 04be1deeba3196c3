"""Standardised context features for draft training, folded away on save.

The draft's ``fc`` reads the concatenated outputs of several target layers.
Pretrained targets carry outlier channels in them: SmolLM2-135M's layer 8
has one channel at ~600 where the typical one is ~5 (position 0, the
attention sink, reaches ~25,000). Such channels dominate ``fc``'s output at
the start, and under Adam, whose step per weight is about the learning rate
whatever the input's size, a weight on a large channel moves the output
hundreds of times further per step than one on a typical channel.

So training feeds ``fc`` the features divided by their per-channel RMS
(measured once on training records, past position 0) and, when the draft is
written, folds the scale into ``fc.weight`` (``W / s``): the saved draft reads
raw features as every engine gives them, in the official format, and
predicts exactly what the trained one did.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from speculative.draft import DFlashDraftModel

if TYPE_CHECKING:
    from speculative.train.draft_train import Features, TargetInputs

MIN_SCALE = 1e-3
"""A channel that is (almost) always zero keeps a scale of at least this."""


def feature_scale(
    features: Features, records: Sequence[tuple[list[int], int]], sample: Sequence[int], pad_id: int
) -> torch.Tensor:
    """Per-channel RMS [n*H] of the target's features over every position but
    the first of the ``sample`` records (indices into ``records``)."""
    total, count = None, 0
    for i in sample:
        tokens = torch.tensor([records[i][0]])
        x = features([i], tokens).features[0, 1:].float()
        squares = x.square().sum(0)
        total = squares if total is None else total + squares
        count += x.shape[0]
    if total is None or not count:
        raise ValueError("no feature positions to measure the scale on")
    return (total / count).sqrt().clamp(min=MIN_SCALE)


def standardized(features: Features, scale: torch.Tensor) -> Features:
    """``features`` with every batch's features divided by ``scale``, in fp32
    (the teacher untouched)."""

    def read(index: list[int], tokens: torch.Tensor) -> TargetInputs:
        inputs = features(index, tokens)
        return dataclasses.replace(inputs, features=inputs.features.float() / scale)

    return read


def unfold_into(draft: DFlashDraftModel, scale: torch.Tensor) -> None:
    """Turn ``draft``'s raw-feature ``fc`` (a saved draft's) into the
    standardised-feature one training uses: ``W * s``, in place."""
    with torch.no_grad():
        draft.fc.weight.mul_(scale.to(draft.fc.weight.dtype))


def folded(draft: DFlashDraftModel, scale: torch.Tensor) -> DFlashDraftModel:
    """A copy of the training ``draft`` that reads raw features: ``fc.weight / s``."""
    out = copy.deepcopy(draft)
    with torch.no_grad():
        out.fc.weight.div_(scale.to(out.fc.weight.dtype))
    return out
