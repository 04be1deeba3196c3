"""Choosing a reduced draft vocabulary from data (FR-Spec / EAGLE-3 style).

The draft proposes only from the K target tokens the training responses use
most: its LM head then costs K/V of the full one in training and serving.
A token outside the subset can never be drafted, so every occurrence of one
costs an accepted token; ``token_coverage`` says how often that happens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch


def response_tokens(records: Iterable[tuple[Sequence[int], int]]) -> Iterator[int]:
    """Every response token of ``(tokens, response start)`` records: the tokens
    a draft must propose (prompt tokens are never drafted)."""
    for tokens, start in records:
        yield from tokens[start:]


def _counts(tokens: Iterable[int], vocab_size: int) -> torch.Tensor:
    ids = torch.tensor(list(tokens), dtype=torch.long)
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    return torch.bincount(ids, minlength=vocab_size)


def frequent_token_ids(tokens: Iterable[int], k: int, *, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``k`` most frequent ids in ``tokens`` (ties, unseen tokens included,
    broken by the smaller id), sorted ascending, as a draft vocabulary map.
    ``always`` ids (e.g. the stop tokens, which end every response once) are in
    it whatever their count."""
    always = sorted(set(always))
    if not len(always) <= k <= vocab_size or k < 1:
        raise ValueError(f"k must be in [max(1, {len(always)} always-included ids), vocab_size={vocab_size}], got {k}")
    if always and not 0 <= always[0] <= always[-1] < vocab_size:
        raise ValueError(f"always-included ids must lie in [0, {vocab_size}), got {always}")
    counts = _counts(tokens, vocab_size)
    counts[always] = counts.max() + 1  # ranked first
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    return order[:k].sort().values


def token_coverage(tokens: Iterable[int], ids: torch.Tensor, *, vocab_size: int) -> float:
    """Fraction of ``tokens`` inside the draft vocabulary ``ids`` (1.0 when
    there are no tokens): the share of positions the draft can still get right."""
    counts = _counts(tokens, vocab_size)
    total = int(counts.sum())
    return int(counts[ids.cpu()].sum()) / total if total else 1.0
