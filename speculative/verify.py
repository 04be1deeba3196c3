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
from speculative.tree import DraftTree


@dataclass
class Verdict:
    """Per row: tokens accepted after the anchor [B] and the token that follows
    them [B]. A tree round (``verify_greedy_tree``) also gives ``kept`` [B, q],
    the block slots of the accepted path (the anchor first), ``path_end`` [B],
    its last slot, and ``draft_accepted`` [B], what the draft's own slots (chain
    and alternates) accepted, to tell the draft's acceptance from lookup's."""

    num_accepted: torch.Tensor
    next_token: torch.Tensor
    kept: torch.Tensor | None = None
    path_end: torch.Tensor | None = None
    draft_accepted: torch.Tensor | None = None

    def kept_slots(self, width: int) -> torch.Tensor:
        """[B, width] bool: the block slots each row commits (a chain round: the
        anchor and its accepted drafts)."""
        if self.kept is not None:
            return self.kept
        slots = torch.arange(width, device=self.num_accepted.device)
        return slots[None, :] <= self.num_accepted[:, None]


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


def verify_greedy_tree(
    block: torch.Tensor, valid: torch.Tensor | None, tree: DraftTree, target_logits: torch.Tensor
) -> Verdict:
    """Greedy over a tree of candidate paths (``speculative.tree``): ``block``
    [B, q] holds the anchor and every candidate, ``target_logits`` [B, q, V]
    the target's scores after each slot's path, ``valid`` [B, q] (None: all)
    marks the slots a row really filled. A slot passes when its token is the
    target's argmax after its parent; a path is accepted up to its first slot
    that does not pass, and the row commits the deepest accepted slot's path
    (on ties the first slot: the chain's) with the target's token after it.
    Exact: every committed token is the target's argmax after its exact prefix,
    the path the target scored it on."""
    device = block.device
    target_tokens = greedy_tokens(target_logits)
    passed = block == target_tokens[:, tree.parent_index(device)]
    passed[:, 0] = True
    if valid is not None:
        passed &= valid
    # A slot is accepted when no slot on its path failed: count failed ancestors with one matmul.
    ancestry = tree.visibility(device)
    failed_on_path = (~passed).to(torch.float32) @ ancestry.T.to(torch.float32)
    depth = torch.where(failed_on_path == 0, tree.depths(device), -1)
    path_end = depth.argmax(dim=1)  # the first of the deepest: the chain wins ties
    return Verdict(
        num_accepted=depth.gather(1, path_end[:, None]).squeeze(1),
        next_token=target_tokens.gather(1, path_end[:, None]).squeeze(1),
        kept=ancestry[path_end],
        path_end=path_end,
        draft_accepted=depth[:, : tree.lookup_start].max(dim=1).values,
    )


def verify_sampled_tree(
    block: torch.Tensor,
    valid: torch.Tensor | None,
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> Verdict:
    """Exact speculative sampling over the chain, the first slot's alternates
    and a lookup path (``speculative.tree``): ``block`` [B, q], ``valid``
    [B, q] (None: all), ``draft_probs`` [B, b-1, V] the chain's q (None:
    argmax proposals), ``target_probs`` [B, q, V] the target's distributions
    after each slot's path.

    Recursive rejection sampling (SpecInfer's, for one sampled candidate and
    fixed ones): at each depth, with p the target's distribution after the
    accepted path, the chain's draft x (drawn from q) is accepted with
    probability min(1, p(x)/q(x)) as in ``verify_sampled``; if it is rejected
    the next distribution is r = normalize(max(0, p - q)). Then each fixed
    candidate y in turn, the lookup token and (at depth 1) the alternates, is
    accepted with probability r(y), and if rejected removed from r (r becomes
    normalize(r with y zeroed)). A fixed candidate may depend on x (the
    alternates are the draft's runner-ups to x): given that x was rejected,
    "take y with probability r(y), else draw from r without y" yields each
    token with probability r(t) whatever y is, and r does not depend on x.
    So each stage leaves the token's distribution exactly p, and the committed
    tokens follow the target. Once one candidate is taken the other path stays
    alive only while its tokens are the same; an alternate has no children, so
    after one only the bonus follows."""
    batch, device = len(block), block.device
    rows = torch.arange(batch, device=device)
    chain_drafts, lookup_slots = tree.chain - 1, tree.lookup
    filled = valid if valid is not None else torch.ones_like(block, dtype=torch.bool)
    depths = max(chain_drafts, lookup_slots)
    u = uniform_rows(generators, 2 * depths + tree.alternates, device)
    end = torch.zeros(batch, dtype=torch.long, device=device)  # the accepted path's last slot
    depth_reached, draft_accepted = torch.zeros_like(end), torch.zeros_like(end)
    # Whether the accepted path's tokens are the chain's / the lookup's (both, while they agree).
    on_chain = torch.ones(batch, dtype=torch.bool, device=device)
    on_lookup = torch.ones_like(on_chain)
    done = torch.zeros_like(on_chain)
    final = torch.zeros_like(target_probs[:, 0])  # each done row's distribution for its next token
    for depth in range(1, depths + 1):
        p = target_probs[rows, end]
        residual = p.clone()
        accept_chain = torch.zeros_like(done)
        if depth <= chain_drafts:
            x = block[:, depth]
            q = torch.zeros_like(p).scatter_(1, x[:, None], 1.0) if draft_probs is None else draft_probs[:, depth - 1]
            q_x, p_x = q.gather(1, x[:, None]).squeeze(1), p.gather(1, x[:, None]).squeeze(1)
            # u < p/q  <=>  u*q < p  (q > 0 for a proposed token): accept with min(1, p/q).
            tried = ~done & on_chain
            accept_chain = tried & (u[:, 2 * depth - 2] * q_x < p_x)
            rejected = tried & ~accept_chain
            residual[rejected] = (p[rejected] - q[rejected]).clamp(min=0.0)
        accept_lookup = torch.zeros_like(done)
        if depth <= lookup_slots:
            slot = tree.lookup_start + depth - 1
            y = block[:, slot]
            tried = ~done & on_lookup & filled[:, slot] & ~accept_chain
            # Accept with r(y) / sum(r): r stays unnormalised, so the draw is scaled instead.
            r_y = residual.gather(1, y[:, None]).squeeze(1)
            accept_lookup = tried & (u[:, 2 * depth - 1] * residual.sum(1) < r_y)
            rejected = tried & ~accept_lookup
            residual[rejected] = residual[rejected].scatter(1, y[rejected, None], 0.0)
            # After the chain's token the lookup path lives on only where it holds the same token.
            kept_alive = accept_chain & filled[:, slot] & (y == block[:, min(depth, chain_drafts)])
            end = torch.where(accept_lookup, slot, end)
            on_lookup &= accept_lookup | kept_alive
        else:
            on_lookup[:] = False
        # The alternates are children of the anchor: candidates at depth 1 only.
        accept_alternate = torch.zeros_like(done)
        for slot in range(tree.chain, tree.lookup_start if depth == 1 else tree.chain):
            z = block[:, slot]
            tried = ~done & filled[:, slot] & ~accept_chain & ~accept_lookup & ~accept_alternate
            r_z = residual.gather(1, z[:, None]).squeeze(1)
            taken = tried & (u[:, 2 * depths + slot - tree.chain] * residual.sum(1) < r_z)
            rejected = tried & ~taken
            residual[rejected] = residual[rejected].scatter(1, z[rejected, None], 0.0)
            end = torch.where(taken, slot, end)
            accept_alternate |= taken
        end = torch.where(accept_chain, depth, end)
        on_chain &= accept_chain
        accepted = accept_chain | accept_lookup | accept_alternate
        ending = ~done & ~accepted
        # max(0, p - q) is zero only when p == q, where rejection has probability 0:
        # fall back to p so rounding can never leave an empty distribution.
        empty = residual.sum(1) <= 0
        residual[empty] = p[empty]
        final[ending] = residual[ending]
        done |= ending
        depth_reached += accepted.long()
        draft_accepted += (accept_chain | accept_alternate).long()
    # Rows whose every candidate passed draw the bonus after their path's end.
    final[~done] = target_probs[rows, end][~done]
    next_token = sample_rows(final, generators)
    ancestry = tree.visibility(device)
    return Verdict(
        num_accepted=depth_reached,
        next_token=next_token,
        kept=ancestry[end],
        path_end=end,
        draft_accepted=draft_accepted,
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
