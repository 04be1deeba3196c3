"""A small in-memory DFlash draft trainer for tiny models (tests and the demo).

Same objective as the training pipeline (``speculative.train.objective``) on
sequences already in memory: no data files, no checkpoints, no progress bar.
"""

from __future__ import annotations

import torch

from speculative.draft import DFlashDraftModel
from speculative.target import TargetModel
from speculative.train.loop import warmup_cosine
from speculative.train.objective import default_gamma, dflash_loss, sample_anchors


def distill_draft(
    draft: DFlashDraftModel,
    target: TargetModel,
    sequences: torch.Tensor,
    prompt_length: int,
    *,
    steps: int = 200,
    rows_per_step: int = 8,
    anchors_per_row: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train ``draft`` on target-generated ``sequences`` [N, S] whose responses start
    at ``prompt_length``. AdamW, warm-up then cosine decay, clipping 1.0. Returns
    the loss of every step."""
    if sequences.shape[1] - prompt_length < 2:
        raise ValueError("sequences need at least two response tokens")
    generator = torch.Generator().manual_seed(seed)
    features = target.forward_sequences(sequences, feature_layers=draft.config.target_layer_ids).features
    assert features is not None  # the forward captured the draft's layers
    for p in target.model.parameters():
        p.requires_grad_(False)
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 25)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, warmup))
    lengths = torch.full((rows_per_step,), sequences.shape[1])
    starts = torch.full((rows_per_step,), prompt_length)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, sequences.shape[0], (rows_per_step,), generator=generator)
        anchors, valid = sample_anchors(lengths, starts, anchors_per_row, generator)
        out = dflash_loss(
            draft, target, sequences[rows], features[rows], lengths, anchors, valid, default_gamma(draft.block_size)
        )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(out.loss.item())
    draft.eval()
    return losses
