"""A small, exact-recipe DFlash draft trainer for tiny models (tests and the demo).

It follows the DFlash objective (REFERENCE section 3) but trains one anchor per
batch row through the inference forward, which is simple and fine for tiny
models; the production pipeline (many blocks per sequence in one forward,
data regeneration, checkpoints) builds on the same loss.

- context: target features of positions strictly before the anchor;
- block: ``[x_anchor, MASK x (b-1)]``, bidirectional;
- labels: slot k predicts ``x[anchor + k]``; slot 0 is excluded;
- weights: ``w_k = exp(-(k-1)/gamma)``; loss = sum(w * CE) / sum(w);
- frozen: the target, its embedding and LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from speculative.draft import DFlashDraftModel
from speculative.target import TargetModel


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of block slots 1..b-1: ``exp(-(k-1)/gamma)``."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dflash_loss(
    draft: DFlashDraftModel,
    target: TargetModel,
    tokens: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """Weighted same-position cross-entropy of one block per row.

    ``tokens`` [M, S] and ``features`` [M, S, n*H] are each row's sequence and
    its target features; ``anchors`` [M] the anchor position per row.
    """
    b = draft.block_size
    device = tokens.device
    seq_positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    # Context strictly before the anchor: later slots are marked ignorable (-1).
    context_positions = torch.where(seq_positions < anchors[:, None], seq_positions, -1)
    context = draft.context_kv(features, seq_positions)
    block_positions = anchors[:, None] + torch.arange(b, device=device)
    block = torch.full_like(block_positions, draft.mask_token_id)
    block[:, 0] = tokens.gather(1, anchors[:, None]).squeeze(1)
    hidden = draft(
        target.embed(block) * draft.config.input_embedding_scale, block_positions, context, context_positions
    )
    logits = target.lm_head(hidden[:, 1:]).float()
    label_positions = block_positions[:, 1:]
    in_range = label_positions < tokens.shape[1]
    labels = tokens.gather(1, label_positions.clamp(max=tokens.shape[1] - 1))
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    weights = position_weights(b, gamma).to(device)[None, :] * in_range
    return (ce * weights).sum() / weights.sum()


def distill_draft(
    draft: DFlashDraftModel,
    target: TargetModel,
    sequences: torch.Tensor,
    prompt_length: int,
    *,
    steps: int = 200,
    anchors_per_step: int = 32,
    lr: float = 3e-3,
    gamma: float = 7.0,
    seed: int = 0,
) -> list[float]:
    """Train ``draft`` on target-generated ``sequences`` [N, S] whose responses start
    at ``prompt_length``; anchors are drawn from response positions. AdamW with
    linear warm-up and cosine decay, gradient clipping 1.0. Returns the losses."""
    if sequences.shape[1] - prompt_length < 2:
        raise ValueError("sequences need at least two response tokens")
    generator = torch.Generator().manual_seed(seed)
    target.capture_layers(draft.config.target_layer_ids)
    with torch.no_grad():
        positions = torch.arange(sequences.shape[1]).expand_as(sequences).to(target.device)
        empty = positions[:, :0]
        features = target.forward(sequences, positions, target.new_cache(), empty).features
    for p in target.model.parameters():
        p.requires_grad_(False)
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 25)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, sequences.shape[0], (anchors_per_step,), generator=generator)
        anchors = torch.randint(prompt_length, sequences.shape[1] - 1, (anchors_per_step,), generator=generator)
        loss = dflash_loss(draft, target, sequences[rows], features[rows], anchors.to(target.device), gamma)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    draft.eval()
    return losses
