"""Repetition penalties, applied before temperature / top-k / top-p, in
vLLM's order:

- ``repetition_penalty`` (the multiplicative CTRL penalty of transformers and
  vLLM, over prompt and generated tokens): a seen token's logit is divided by
  the penalty when positive and multiplied by it when negative;
- OpenAI's ``presence_penalty`` and ``frequency_penalty`` (additive, over the
  tokens generated so far): ``logit -= presence * [count > 0] + frequency * count``.

A penalised distribution depends on the tokens before it, so inside a verified
block each slot is penalised with the row's history plus the block's tokens on
its own path: slots 1..j for chain slot j, the anchor's child alone for a
first-slot alternate, and the lookup path's tokens up to the slot for a lookup
slot (``speculative.tree``). Each slot's distribution is then exactly the one
plain decoding would use after the same prefix, and verification stays
lossless for the penalised target, whichever path it commits.
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
    paths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalised logits [B, n, V] (float32). ``drafts`` [B, n-1] are the block's
    tokens after the anchor (slots 1..n-1), and position j also counts those on
    its path: ``paths`` [n, n] (``DraftTree.visibility``: slot j sees slot t),
    or by default slots 1..j, a chain. Without ``drafts`` every position sees
    only the history. Rows without penalties are unchanged, and ``logits``
    itself is returned when no row has one.

    A penalty changes only the columns of tokens the row has seen or the block
    holds, so each penalised row computes those columns alone: over all 49k
    columns one penalised row cost a batch of 8 a 14-slot tree block 118 ms a
    round on a CPU core (docs/LOG.md)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    device = logits.device
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    n = logits.shape[1]
    # on_path[j, t]: block slot t + 1 is on slot j's path.
    on_path = (torch.ones(n, n, device=device).tril() if paths is None else paths.to(device, torch.float32))[:, 1:]
    no_drafts = torch.zeros(0, dtype=torch.long, device=device)
    for i in rows:
        p, block = params[i], no_drafts if drafts is None else drafts[i]
        columns = torch.unique(torch.cat([history.seen[i].nonzero().flatten(), block]))
        counts = history.counts[i, columns].expand(n, -1)
        if len(block):
            counts = counts + on_path[:, : len(block)] @ (block[:, None] == columns[None, :]).float()
        seen = history.seen[i, columns] | (counts > 0)
        values = logits[i, :, columns]
        # vLLM's order: the multiplicative penalty on raw logits, then the additive ones.
        scaled = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        values = torch.where(seen, scaled, values)
        logits[i, :, columns] = values - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
    return logits
