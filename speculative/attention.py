"""Grouped-query attention for verify blocks without copying the cache.

transformers' SDPA path serves a grouped-query model (fewer K/V heads than query
heads) in one of two ways: one query token attends per K/V head (``pack_gqa``),
but a block of q > 1 tokens with a mask gets its cached keys and values
*repeated* to every query head first (``repeat_kv``): a copy of the whole cache,
per layer, per forward. Plain decoding (q = 1) never pays it and a verify block
always does, so it made DFlash look dearer than it is: on SmolLM2-135M (9 query
heads on 3 K/V heads, 30 layers) it was most of the step that verifying 6
tokens costs over decoding 1, and it grows with the context (docs/LOG.md).

``grouped_query_sdpa`` generalises ``pack_gqa`` to any q: the queries of the
heads that share a K/V head become one longer query block, with the mask's rows
repeated to match (masks here are shared by all heads), so attention reads the
cache as it lies. Same attention, same kernel; ``use_grouped_attention`` switches
a loaded model to it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from speculative.masks import RowSpan, by_spans

GROUPED_SDPA = "grouped_query_sdpa"  # no "flash" in it: transformers reads that as a flash-attention kernel


def grouped_query_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_spans: tuple[RowSpan, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [B, H, q, d],
    ``key``/``value`` [B, kvh, T, d], ``attention_mask`` [B, 1, q, T] additive;
    returns [B, q, H, d]. ``row_spans`` (``speculative.masks.row_spans``, passed
    through the model's keyword arguments): attend span by span, each from its
    first key column, so no row reads a longer neighbour's padding."""

    def attend(rows: slice, first: int) -> torch.Tensor:
        mask = None if attention_mask is None else attention_mask[rows, ..., first:]
        return _grouped_query_sdpa(
            module, query[rows], key[rows, :, first:], value[rows, :, first:], mask, dropout, scaling, **kwargs
        )[0]

    return by_spans(row_spans, query.shape[0], attend), None


def _grouped_query_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One call; cases the grouping does not improve go to transformers' SDPA."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, length, dim = query.shape
    # Only a mask shared by all heads ([B, 1, q, T]) can be repeated along the grouped rows.
    if (
        groups == 1
        or length == 1
        or attention_mask is None
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    # Head h = kv * groups + r reads K/V head kv: its query rows go to block rows r * q + i of head kv.
    grouped = query.reshape(batch, heads // groups, groups * length, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` from transformers' SDPA to ``grouped_query_sdpa`` when it
    uses SDPA; returns whether the model uses it now (other implementations are left alone)."""
    current = str(model.config._attn_implementation)
    if current != "sdpa":
        return current == GROUPED_SDPA
    AttentionInterface.register(GROUPED_SDPA, grouped_query_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    return True
