"""The DFlash training objective (the DFlash paper's recipe; docs/training.md), many blocks per sequence
in one draft forward.

For each sequence, ``m`` anchors are drawn from response positions; anchor a
opens the block ``[x_a, MASK x (b-1)]`` at positions ``a .. a+b-1``. All blocks
of a row go through ONE draft forward, kept apart by a block-sparse mask:

- a block token sees the context strictly BEFORE its anchor (``kv < a``, not
  ``<=``: the anchor's own feature is not known at serving time either),
- every token of its own block (bidirectional),
- nothing of the other blocks.

Slot k (1..b-1) predicts ``x[a + k]`` at its own position; slot 0 is excluded;
the loss is ``sum(w * CE) / sum(w)`` with ``w_k = exp(-(k-1)/gamma)``.

A draft with a reduced draft vocabulary is trained on K-way logits only (full-
vocabulary logits are never formed: that is its saving). Labels outside its
vocabulary are left out of the loss, since the draft can never propose them,
but count as wrong in the accuracy statistics, since serving rejects there.

Distillation (``teacher``, ``distill_weight`` w): beside the hard label, slot k
also learns the target's own next-token distribution at position ``a + k - 1``
(its stored top-k, renormalised over the draft vocabulary): the loss per slot
is ``(1 - w) * CE(label) + w * CE(teacher)``. Greedy serving accepts the
target's argmax, which the label already is for greedy data; the teacher adds
how close the runner-up was, a denser signal per token than the label alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.draft import DFlashDraftModel
from speculative.target import TargetModel

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def coverage_counts(
    lengths: torch.Tensor, starts: torch.Tensor, block_size: int, coverage: float, most: int
) -> torch.Tensor:
    """Anchors per row so that each response token is a label of about
    ``coverage`` blocks (a block labels b - 1 tokens), at least 1 and at most
    ``most``: a fixed count per row would cover a short response many times
    over and a long one thinly."""
    wanted = torch.ceil(coverage * (lengths - starts).clamp(min=1) / (block_size - 1)).long()
    return wanted.clamp(1, most)


def default_gamma(block_size: int) -> float:
    """The paper's decay for its block sizes; for others, interpolated as b/2 - 1."""
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2 - 1))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of block slots 1..b-1: ``exp(-(k-1)/gamma)``."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_visibility(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean [B, m*b, S + m*b]: which keys (S context positions, then the m*b
    block tokens) each block token may see. ``anchors`` [B, m]."""
    batch, m = anchors.shape
    device = anchors.device
    block_of_query = torch.arange(m, device=device).repeat_interleave(block_size)
    anchor_of_query = anchors[:, block_of_query]
    context = torch.arange(seq_len, device=device)[None, None, :] < anchor_of_query[:, :, None]
    same_block = (block_of_query[:, None] == block_of_query[None, :]).expand(batch, -1, -1)
    return torch.cat([context, same_block], dim=2)


def sample_anchors(
    lengths: torch.Tensor, starts: torch.Tensor, count: int | torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` (one number, or one per row) distinct anchors per row from
    ``[starts, lengths - 1)`` (an anchor needs at least one label after it),
    sorted; rows with fewer get padding anchors, marked invalid. Returns
    (anchors, valid) [B, the largest count]."""
    counts = torch.as_tensor(count).expand(len(lengths)).tolist()
    anchors = torch.zeros(len(lengths), max(counts), dtype=torch.long)
    valid = torch.zeros(len(lengths), max(counts), dtype=torch.bool)
    rows = zip(starts.tolist(), (lengths - 1).tolist(), counts, strict=True)
    for row, (start, end, row_count) in enumerate(rows):
        candidates = torch.arange(start, max(start, end))
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:row_count]].sort().values
        anchors[row, : len(chosen)] = chosen
        valid[row, : len(chosen)] = True
    return anchors, valid


@dataclass
class LossOutput:
    """The weighted loss and, per block slot 1..b-1, correct and counted labels
    (labels outside a reduced draft vocabulary are counted, never correct)."""

    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor


def block_logits(
    draft: DFlashDraftModel,
    target: TargetModel,
    tokens: torch.Tensor,
    features: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """Logits [B, m, b-1, K] over the draft vocabulary (K = V and index = token
    id without a reduced one; ``draft.target_ids`` maps indices back) of block
    slots 1..b-1 of the block each anchor opens, every block of a row in ONE
    draft forward under the block-sparse mask.

    ``tokens`` [B, S] (right-padded), ``features`` [B, S, n*H] the target's
    features of those tokens, ``lengths`` [B] real tokens per row, ``anchors``
    [B, m] anchor positions.
    """
    b = draft.block_size
    batch, seq_len = tokens.shape
    device = tokens.device
    positions = torch.arange(seq_len, device=device).expand(batch, -1)
    context_positions = torch.where(positions < lengths[:, None], positions, -1)
    context = draft.context_kv(features, positions)

    block_positions = (anchors[:, :, None] + torch.arange(b, device=device)).flatten(1)
    block = torch.full_like(block_positions, draft.mask_token_id)
    block[:, ::b] = tokens.gather(1, anchors)
    embeddings = target.embed(block) * draft.config.input_embedding_scale
    visible = block_visibility(anchors, seq_len, b)
    hidden = draft(embeddings, block_positions, context, context_positions, visible=visible)
    hidden = hidden.view(batch, -1, b, hidden.shape[-1])[:, :, 1:]  # slot 0 is the anchor: no prediction
    return draft.draft_logits(hidden, target, full_vocab=False).float()


def dflash_loss(
    draft: DFlashDraftModel,
    target: TargetModel,
    tokens: torch.Tensor,
    features: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    gamma: float,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    distill_weight: float = 0.0,
) -> LossOutput:
    """DFlash loss of a batch (arguments as ``block_logits``; ``anchor_valid``
    [B, m] False for padding anchors; ``teacher``: the target's top-k next-token
    ids and log-probabilities [B, S, k] per position, padding id -1, used with
    weight ``distill_weight``)."""
    b = draft.block_size
    seq_len = tokens.shape[1]
    logits = block_logits(draft, target, tokens, features, lengths, anchors)
    label_positions = anchors[:, :, None] + torch.arange(1, b, device=tokens.device)
    labels = tokens.gather(1, label_positions.clamp(max=seq_len - 1).flatten(1)).view_as(label_positions)
    labels = draft.draft_index(labels)  # -1: outside the draft vocabulary
    counted = anchor_valid[:, :, None] & (label_positions < lengths[:, None, None])
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-1, reduction="none").view_as(labels)
    slot_weights = position_weights(b, gamma).to(tokens.device)
    weights = slot_weights * (counted & (labels >= 0))
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-8)
    if teacher is not None and distill_weight > 0:
        soft, known = teacher_cross_entropy(draft, logits, teacher, label_positions - 1)
        soft_weights = slot_weights * (counted & known)
        soft_loss = (soft * soft_weights).sum() / soft_weights.sum().clamp(min=1e-8)
        loss = (1 - distill_weight) * loss + distill_weight * soft_loss
    correct = ((logits.argmax(-1) == labels) & counted).sum(dim=(0, 1))
    return LossOutput(loss=loss, correct=correct, counted=counted.sum(dim=(0, 1)))


def teacher_cross_entropy(
    draft: DFlashDraftModel,
    logits: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy [B, m, b-1] of the draft's slot ``logits`` [B, m, b-1, K]
    against the teacher's distribution at ``positions`` [B, m, b-1]: its top-k
    probabilities inside the draft vocabulary, renormalised (what the draft can
    propose); and whether any of that mass was inside (else nothing to learn)."""
    ids, logprobs = teacher
    flat = positions.clamp(0, ids.shape[1] - 1).flatten(1)[:, :, None].expand(-1, -1, ids.shape[-1])
    top_ids = ids.gather(1, flat).view(*positions.shape, -1)
    top_logprobs = logprobs.gather(1, flat).view(*positions.shape, -1)
    index = draft.draft_index(top_ids)
    inside = index >= 0
    probs = torch.where(inside, top_logprobs.exp(), 0.0)
    mass = probs.sum(-1, keepdim=True)
    probs = probs / mass.clamp(min=1e-12)
    draft_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, index.clamp(min=0))
    return -(probs * draft_logprobs).sum(-1), mass[..., 0] > 0


@torch.no_grad()
def greedy_guess_matches(draft: DFlashDraftModel, target: TargetModel, sequence: list[int], start: int) -> torch.Tensor:
    """[m, b-1] bool: whether the draft's argmax at block slot k of the block
    opened at each response position ``start .. len - 2`` equals the token
    ``sequence`` has there (False past its end); with a reduced draft
    vocabulary the argmax index is mapped back to its token id first. One
    packed forward: context strictly before the anchor, as in serving."""
    b, n = draft.block_size, len(sequence)
    tokens = torch.tensor([sequence])
    anchors = torch.arange(start, n - 1)[None]
    features = target.forward_sequences(tokens, feature_layers=draft.config.target_layer_ids).features
    assert features is not None  # the forward captured the draft's layers
    guesses = draft.target_ids(block_logits(draft, target, tokens, features, torch.tensor([n]), anchors)[0].argmax(-1))
    truth = torch.tensor(sequence + [-1] * b)[anchors[0, :, None] + torch.arange(1, b)]
    return guesses == truth


def chain_rounds(matches: torch.Tensor) -> list[int]:
    """Drafts greedy serving accepts per round, given ``greedy_guess_matches``
    of a sequence: the first anchor is the first response token, a round
    accepts the longest matching prefix of its guesses, and the next anchor is
    the token after the accepted ones (the bonus)."""
    accepted = torch.cumprod(matches.int(), dim=1).sum(dim=1).tolist()  # leading matches per anchor
    rounds, anchor = [], 0
    while anchor < len(accepted):
        rounds.append(accepted[anchor])
        anchor += accepted[anchor] + 1
    return rounds


def simulated_greedy_rounds(draft: DFlashDraftModel, target: TargetModel, sequence: list[int], start: int) -> list[int]:
    """Drafts greedy serving at the draft's block would accept per round while
    decoding ``sequence[start:]`` (the target's own greedy continuation of
    ``sequence[:start]``), from one packed forward instead of a decode loop.
    Serving that loses context or shifts a position accepts less than this;
    the engine tests compare the two. Rounds near the end count only the
    tokens ``sequence`` still has."""
    return chain_rounds(greedy_guess_matches(draft, target, sequence, start))
