"""Acceptance of a drafted block against the target's distributions, batched over rows.

Shapes: ``drafts`` [B, b-1] are the drafted tokens at block slots 1..b-1;
``target_logits`` / ``target_probs`` [B, b, V] are the target's next-token
distributions after each block slot (slot j's distribution judges the draft at
slot j+1; the last one gives the bonus). Each row gets ``num_accepted`` in
[0, b-1] and ``next_token``: the correction at the first rejection, or the bonus
when every draft passed. The row commits ``anchor + drafts[:num_accepted]``
and ``next_token`` becomes its next anchor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculative.sampling import greedy_tokens, sample_rows, uniform_rows


@dataclass
class Verdict:
    """Per row: drafts accepted [B] and the token that follows them [B];
    ``branch`` [B]: which first-slot alternate was accepted instead of the
    chain (-1: none; None: the round had no alternates)."""

    num_accepted: torch.Tensor
    next_token: torch.Tensor
    branch: torch.Tensor | None = None

    def kept_slots(self, block_size: int, num_alternates: int) -> torch.Tensor:
        """[B, block_size + num_alternates] bool: the block slots each row commits
        (the anchor, then its accepted chain drafts or its accepted alternate)."""
        slots = torch.arange(block_size + num_alternates, device=self.num_accepted.device)
        chain = (slots[None, :] <= self.num_accepted[:, None]) & (slots[None, :] < block_size)
        if self.branch is None:
            return chain
        branch = self.branch[:, None]
        return torch.where(branch >= 0, (slots[None, :] == 0) | (slots[None, :] == block_size + branch), chain)


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accept`` [B, n] -> [B]."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy: accept the longest prefix where draft == target argmax, then take the
    target's own token at the first mismatch (or the bonus after the last slot)."""
    return _greedy_chain(drafts, greedy_tokens(target_logits))


def _greedy_chain(drafts: torch.Tensor, target_tokens: torch.Tensor) -> Verdict:
    """``verify_greedy`` on the target's argmax tokens [B, >= b] (slots past b ignored)."""
    num_accepted = accepted_prefix(drafts == target_tokens[:, : drafts.shape[1]])
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return Verdict(num_accepted=num_accepted, next_token=next_token)


def verify_greedy_branches(drafts: torch.Tensor, alternates: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy over a tree: the chain ``drafts`` [B, b-1] at block slots 1..b-1,
    plus ``alternates`` [B, m], other candidates for slot 1 at slots b..b+m-1,
    each seeing only the anchor (``target_logits`` [B, b+m, V]). The chain is
    judged as ``verify_greedy``; when its first draft fails and an alternate
    is the target's token after the anchor, that alternate is accepted and the
    target's token after it (its own slot's argmax) follows. Exact: every
    committed token is the target's argmax after its exact prefix."""
    block_size = drafts.shape[1] + 1
    target_tokens = greedy_tokens(target_logits)
    chain = _greedy_chain(drafts, target_tokens)
    # Alternates differ from the chain's first draft, so at most one of the two can match.
    hit = alternates == target_tokens[:, :1]
    taken = (chain.num_accepted == 0) & hit.any(dim=1)
    branch = torch.where(taken, hit.to(torch.int8).argmax(dim=1), -1)
    after_branch = target_tokens.gather(1, (block_size + branch.clamp(min=0))[:, None]).squeeze(1)
    return Verdict(
        num_accepted=torch.where(taken, 1, chain.num_accepted),
        next_token=torch.where(taken, after_branch, chain.next_token),
        branch=branch,
    )


def verify_sampled(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> Verdict:
    """Exact speculative (rejection) sampling.

    Draft token x_k, proposed with probability q_k(x_k), is accepted with
    probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection the next
    token is drawn from normalize(max(0, p_k - q_k)); if all pass, the bonus is
    drawn from the last p. ``draft_probs`` None means argmax proposals (q is the
    one-hot of the draft), also exact. DFlash drafts every slot in parallel, so
    q_k does not depend on earlier drafts and the usual proof applies unchanged.
    """
    batch, num_drafts = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    p_of_draft = target_probs[:, :num_drafts].gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    u = uniform_rows(generators, num_drafts, drafts.device)
    # u < p/q  <=>  u*q < p  (q > 0 for a proposed token): accept with min(1, p/q).
    num_accepted = accepted_prefix(u * q_of_draft < p_of_draft)

    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts
    slot = num_accepted.clamp(max=max(num_drafts - 1, 0))
    q_next = torch.zeros_like(p_next)
    if num_drafts > 0:
        if draft_probs is None:
            q_next[rows, drafts[rows, slot]] = 1.0
        else:
            q_next = draft_probs[rows, slot].clone()
        q_next[~rejected] = 0.0
    residual = (p_next - q_next).clamp(min=0.0)
    # max(0, p - q) is zero only when p == q, where rejection has probability 0;
    # fall back to p so rounding can never leave an empty distribution.
    empty = residual.sum(dim=-1) <= 0
    residual[empty] = p_next[empty]
    next_token = sample_rows(residual, generators)
    return Verdict(num_accepted=num_accepted, next_token=next_token)
