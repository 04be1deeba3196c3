"""Attention masks from per-row token positions.

Every cache slot carries the absolute position of the token it holds, or -1 when
it holds nothing useful (left padding, or a drafted token the target rejected).
Masks are built from positions alone, so rows of one batch may hold different
numbers of committed tokens in the same cache tensor.
"""

from __future__ import annotations

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
