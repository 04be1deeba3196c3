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


def tree_visibility(block_size: int, num_alternates: int, device: torch.device) -> torch.Tensor:
    """[q, q] bool over a verify block of q = ``block_size + num_alternates``
    tokens: the chain (slots 0..b-1, each sees those before it) and the
    alternates for its first drafted slot (slots b.., each sees the anchor at
    slot 0 and itself only, as if it stood at slot 1 alone)."""
    q = block_size + num_alternates
    visible = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    visible[block_size:, 1:block_size] = False
    visible[block_size:, block_size:] = torch.eye(num_alternates, dtype=torch.bool, device=device)
    return visible
