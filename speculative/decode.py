"""Speculative generation with a DFlash draft: prefill, then rounds of
propose -> verify -> accept -> commit over a whole batch.

One round, for every row at once:
  propose: ONE draft forward over ``[anchor, MASK x (b-1)]`` at the row's next b
           positions, against the draft's context cache -> b-1 drafted tokens;
  verify:  ONE target forward over ``[anchor, drafts]`` -> b distributions;
  accept:  greedy prefix match or exact rejection sampling (``speculative.verify``);
  commit:  the anchor and the accepted drafts stay in both caches, the rest of the
           block's slots are masked out; the correction/bonus token becomes the next
           anchor (it enters the caches when it is verified next round).
Rows accept different lengths in the same round; ``speculative.batch`` keeps
the ragged caches. ``b = 1`` is plain autoregressive decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from speculative.batch import RaggedBatch, append_draft_context, draft_context
from speculative.draft import DFlashDraftModel
from speculative.sampling import (
    GREEDY,
    SamplingParams,
    make_generators,
    probabilities,
    sample_positions,
    sample_rows,
)
from speculative.target import TargetModel
from speculative.verify import Verdict, verify_greedy, verify_sampled


@dataclass(frozen=True)
class DecodeConfig:
    """Settings of one ``spec_generate`` call.

    block_size: tokens per verify block, the anchor included (16 -> 15 drafts;
        1 -> plain decoding, no draft needed).
    max_new_tokens: generated tokens per prompt at most.
    stop_token_ids: a generated token from this set ends its row (it is kept).
    proposal: "argmax" drafts the draft's most likely token at each slot (q is a
        point mass), "sample" samples it from the warped draft distribution.
    compact_slack: compact the caches once this many slots per row are wasted.
    """

    block_size: int = 16
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    proposal: Literal["argmax", "sample"] = "argmax"
    compact_slack: int = 64

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.proposal not in ("argmax", "sample"):
            raise ValueError(f"proposal must be 'argmax' or 'sample', got {self.proposal!r}")
        if self.compact_slack < 0:
            raise ValueError(f"compact_slack must be >= 0, got {self.compact_slack}")


@dataclass
class RoundStats:
    """One propose/verify round over the batch.

    accepted: committed tokens per row this round (accepted drafts + 1), i.e. tau.
    accepted_per_position[k]: rows whose draft at block slot k+1 was accepted.
    verified_per_position[k]: rows that had a draft at block slot k+1 verified.
    """

    batch_size: int
    block_size: int
    accepted: list[int]
    accepted_per_position: list[int]
    verified_per_position: list[int]
    draft_seconds: float
    verify_seconds: float

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tau over the rows of this round."""
        return sum(self.accepted) / len(self.accepted)


@dataclass
class GenerationResult:
    """Generated tokens per prompt (prompt excluded), why each row stopped
    ("stop" or "length"), and per-round statistics."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_seconds: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per row-round over the whole run (tau)."""
        total = sum(sum(r.accepted) for r in self.rounds)
        count = sum(len(r.accepted) for r in self.rounds)
        return total / count if count else 0.0


def check_pair(target: TargetModel, draft: DFlashDraftModel) -> None:
    """Raise ``DraftTargetMismatch`` when ``draft`` cannot run on ``target``."""
    draft.config.check_target(
        hidden_size=target.hidden_size,
        num_layers=target.num_layers,
        embedding_rows=target.embedding_rows,
        vocab_size=target.vocab_size,
    )


@torch.inference_mode()
def spec_generate(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
) -> GenerationResult:
    """Generate continuations of ``prompts`` (token ids) with DFlash speculation.

    The output distribution is exactly the target's; with greedy sampling the
    tokens equal target-only greedy decoding. ``sampling`` is one setting for
    all rows or one per prompt.
    """
    params = _per_row_sampling(sampling, len(prompts))
    _check_inputs(target, draft, prompts, config)
    if config.block_size == 1:
        draft = None  # plain decoding: no proposals, no draft context to keep
    else:
        target.capture_layers(draft.config.target_layer_ids)
    device = target.device
    outputs: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)

    start = _clock(device)
    batch, first_logits = _prefill(target, draft, prompts)
    generators = make_generators(params, device)
    rows = _ActiveRows(list(range(len(prompts))), _sample_next(first_logits, params, generators), params, generators)
    result = GenerationResult(tokens=outputs, finish_reasons=reasons, prefill_seconds=_clock(device) - start)
    done = _emit(outputs, reasons, rows.ids, [[t] for t in rows.anchors.tolist()], config)

    while not all(done):
        if any(done):
            keep = [i for i, finished in enumerate(done) if not finished]
            batch.select_rows(torch.tensor(keep, device=device))
            rows.keep(keep)
        if batch.wasted_slots() >= config.compact_slack:
            batch.compact()
        stats, emitted = _decode_round(target, draft, batch, rows, config)
        result.rounds.append(stats)
        done = _emit(outputs, reasons, rows.ids, emitted, config)
    return result


@dataclass
class _ActiveRows:
    """The rows still decoding: prompt index, current anchor, sampling state."""

    ids: list[int]
    anchors: torch.Tensor
    params: list[SamplingParams]
    generators: list[torch.Generator]

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at these batch indices."""
        self.ids = [self.ids[i] for i in keep]
        self.anchors = self.anchors[torch.tensor(keep, device=self.anchors.device)]
        self.params = [self.params[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]


def _decode_round(
    target: TargetModel, draft: DFlashDraftModel | None, batch: RaggedBatch, rows: _ActiveRows, config: DecodeConfig
) -> tuple[RoundStats, list[list[int]]]:
    """One propose -> verify -> accept -> commit round; returns its stats and the
    tokens each row emits (accepted drafts, then the correction or bonus)."""
    device = target.device
    b = config.block_size
    positions = batch.lengths[:, None] + torch.arange(b, device=device)
    t0 = _clock(device)
    drafts, draft_probs = _propose(target, draft, batch, rows, positions, config)
    t1 = _clock(device)
    block = torch.cat([rows.anchors[:, None], drafts], dim=1)
    verified = target.forward(block, positions, batch.target_cache, batch.slot_positions, capture=draft is not None)
    verdict = _accept(drafts, draft_probs, verified.logits, rows)
    _commit(batch, draft, verdict, positions, verified.features)
    t2 = _clock(device)

    num_accepted = verdict.num_accepted.tolist()
    emitted = [[*d[:n], t] for d, n, t in zip(drafts.tolist(), num_accepted, verdict.next_token.tolist(), strict=True)]
    rows.anchors = verdict.next_token
    return _round_stats(num_accepted, b, t1 - t0, t2 - t1), emitted


def _per_row_sampling(sampling: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    if len(sampling) != n:
        raise ValueError(f"got {len(sampling)} sampling settings for {n} prompts")
    return list(sampling)


def _check_inputs(
    target: TargetModel, draft: DFlashDraftModel | None, prompts: Sequence[Sequence[int]], config: DecodeConfig
) -> None:
    if not prompts:
        raise ValueError("no prompts")
    if config.block_size > 1:
        if draft is None:
            raise ValueError(f"block_size {config.block_size} needs a draft model")
        if config.block_size > draft.block_size:
            raise ValueError(f"block_size {config.block_size} exceeds the draft's trained block {draft.block_size}")
        check_pair(target, draft)
        weight = draft.fc.weight
        if (weight.device, weight.dtype) != (target.device, target.dtype):
            raise ValueError(
                f"draft is on {weight.device} in {weight.dtype} but the target is on {target.device} in "
                f"{target.dtype}: load both on one device with one dtype"
            )
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if min(prompt) < 0 or max(prompt) >= target.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {target.vocab_size})")
        if len(prompt) + config.max_new_tokens > target.context_length:
            raise ValueError(
                f"prompt {i}: {len(prompt)} prompt tokens + {config.max_new_tokens} new tokens exceed "
                f"the target's context length {target.context_length}"
            )


def _prefill(
    target: TargetModel, draft: DFlashDraftModel | None, prompts: Sequence[Sequence[int]]
) -> tuple[RaggedBatch, torch.Tensor]:
    """Run the target over the left-padded prompts, fill both caches, return the
    batch state and each row's last logits [B, V]."""
    device = target.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    positions = torch.full((len(prompts), width), -1, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, device=device)
        positions[i, width - len(prompt) :] = torch.arange(len(prompt), device=device)
    batch = RaggedBatch(
        slot_positions=torch.empty(len(prompts), 0, dtype=torch.long, device=device),
        target_cache=target.new_cache(),
        draft_cache=target.new_cache() if draft is not None else None,
    )
    out = target.forward(ids, positions, batch.target_cache, batch.slot_positions, capture=draft is not None)
    if draft is not None:
        append_draft_context(batch.draft_cache, draft.context_kv(out.features, positions))
    batch.commit(positions)
    return batch, out.logits[:, -1]


def _propose(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    batch: RaggedBatch,
    rows: _ActiveRows,
    positions: torch.Tensor,
    config: DecodeConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft b-1 tokens per row in one draft forward; returns the drafts [B, b-1]
    and, for sampled proposals, their distributions q [B, b-1, V]."""
    b = positions.shape[1]
    if b == 1:
        return rows.anchors.new_empty(len(rows.anchors), 0), None
    block = torch.full_like(positions, draft.mask_token_id)
    block[:, 0] = rows.anchors
    embeddings = target.embed(block) * draft.config.input_embedding_scale
    hidden = draft(embeddings, positions, draft_context(batch.draft_cache), batch.slot_positions)
    # Slot 0 (the anchor) is discarded; slot j predicts the token at its own position.
    logits = target.lm_head(hidden[:, 1:])
    if config.proposal == "argmax":
        return logits.argmax(dim=-1), None
    q = probabilities(logits, rows.params)
    return sample_positions(q, rows.generators), q


def _accept(
    drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor, rows: _ActiveRows
) -> Verdict:
    if all(p.greedy for p in rows.params):
        return verify_greedy(drafts, target_logits)
    return verify_sampled(drafts, draft_probs, probabilities(target_logits, rows.params), rows.generators)


def _commit(
    batch: RaggedBatch,
    draft: DFlashDraftModel | None,
    verdict: Verdict,
    positions: torch.Tensor,
    features: torch.Tensor | None,
) -> None:
    """Keep the anchor and accepted drafts of the appended block in both caches."""
    slots = torch.arange(positions.shape[1], device=positions.device)
    batch.commit(torch.where(slots[None, :] <= verdict.num_accepted[:, None], positions, -1))
    if draft is not None:
        append_draft_context(batch.draft_cache, draft.context_kv(features, positions))


def _sample_next(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    return sample_rows(probabilities(logits[:, None], params)[:, 0], generators)


def _emit(
    outputs: list[list[int]], reasons: list[str], rows: list[int], new: list[list[int]], config: DecodeConfig
) -> list[bool]:
    """Append each active row's new tokens, cut at a stop token or the length
    limit; returns which rows finished."""
    stop = set(config.stop_token_ids)
    done = []
    for row, tokens in zip(rows, new, strict=True):
        out = outputs[row]
        for token in tokens:
            out.append(token)
            if token in stop:
                reasons[row] = "stop"
                break
            if len(out) >= config.max_new_tokens:
                break
        done.append(reasons[row] == "stop" or len(out) >= config.max_new_tokens)
    return done


def _round_stats(num_accepted: list[int], b: int, draft_seconds: float, verify_seconds: float) -> RoundStats:
    return RoundStats(
        batch_size=len(num_accepted),
        block_size=b,
        accepted=[n + 1 for n in num_accepted],
        accepted_per_position=[sum(n > k for n in num_accepted) for k in range(b - 1)],
        verified_per_position=[len(num_accepted)] * (b - 1),
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
    )


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
