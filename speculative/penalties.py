"""Repetition penalties, applied before temperature / top-k / top-p, in
vLLM's order:

- ``repetition_penalty`` (the multiplicative CTRL penalty of transformers and
  vLLM, over prompt and generated tokens): a seen token's logit is divided by
  the penalty when positive and multiplied by it when negative;
- OpenAI's ``presence_penalty`` and ``frequency_penalty`` (additive, over the
  tokens generated so far): ``logit -= presence * [count > 0] + frequency * count``.

A penalised distribution depends on the tokens before it, so inside a verified
block position j is penalised with the row's history plus the block's drafts
at slots 1..j (the tokens that precede it). Each position's distribution is
then exactly the one plain decoding would use after the same prefix, and
verification stays lossless for the penalised target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculative.sampling import SamplingParams


@dataclass
class TokenHistory:
    """Per row: how often each token was generated (``counts`` [B, V]) and
    whether it occurs in the prompt or the output (``seen`` [B, V])."""

    counts: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def from_prompts(cls, prompts: Sequence[Sequence[int]], vocab: int, device: torch.device) -> TokenHistory:
        seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
        for i, prompt in enumerate(prompts):
            seen[i, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        return cls(torch.zeros(len(prompts), vocab, device=device), seen)

    def add(self, tokens: Sequence[Sequence[int]]) -> None:
        """Record each row's newly generated tokens."""
        for i, row in enumerate(tokens):
            if row:
                ids = torch.tensor(list(row), dtype=torch.long, device=self.counts.device)
                self.counts[i].index_add_(0, ids, torch.ones(len(ids), device=self.counts.device))
                self.seen[i, ids] = True

    def select(self, index: torch.Tensor) -> None:
        self.counts, self.seen = self.counts[index], self.seen[index]

    def extend(self, other: TokenHistory) -> None:
        self.counts = torch.cat([self.counts, other.counts])
        self.seen = torch.cat([self.seen, other.seen])


def any_penalty(params: Sequence[SamplingParams]) -> bool:
    return any(p.penalized for p in params)


def penalize(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: TokenHistory,
    drafts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalised logits [B, n, V]. Position j also counts ``drafts[:, :j]``
    ([B, n-1]: the block's tokens after the anchor); without ``drafts`` every
    position sees only the history. Rows without penalties are unchanged."""
    if not any_penalty(params):
        return logits
    device, logits = logits.device, logits.float()
    batch, n, vocab = logits.shape
    counts = history.counts[:, None, :].expand(batch, n, vocab)
    if drafts is not None and drafts.shape[1] > 0:
        one_hot = torch.zeros(batch, n, vocab, device=device)
        one_hot[:, 1:].scatter_(-1, drafts[..., None], 1.0)
        counts = counts + one_hot.cumsum(dim=1)
    seen = history.seen[:, None, :] | (counts > 0)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device)[:, None, None]

    presence = column([p.presence_penalty for p in params])
    frequency = column([p.frequency_penalty for p in params])
    repetition = column([p.repetition_penalty for p in params])
    # vLLM's order: the multiplicative penalty on raw logits, then the additive ones.
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    return logits - presence * (counts > 0) - frequency * counts
