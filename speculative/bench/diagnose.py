"""``dflash-bench --diagnose``: where a tau comes from, measured on the
target's own greedy outputs (the ones the benchmark just decoded).

- Target: how sure it is of the tokens it emits, i.e. the top-1 probability of
  the distribution it decodes from (penalties applied). A target that is
  rarely sure picks its argmax by margins a small draft seldom reproduces.
- Draft: teacher-forced accuracy at block slots 1-4 with a block opened at
  every response position (``greedy_guess_matches``, the training objective's
  packed forward).
- Engine: the tau those predictions give when rounds are chained as serving
  chains them (``chain_rounds``), next to the measured tau at the draft's
  block; the two agree up to end effects when serving gives the draft the
  context training did. Serving opens every round right after a rejected
  draft, at positions harder than average, so its slot-1 acceptance is below
  the teacher-forced slot-1 accuracy over all positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speculative.draft import DFlashDraftModel
from speculative.penalties import TokenHistory, penalize
from speculative.sampling import SamplingParams
from speculative.target import TargetModel
from speculative.train.objective import chain_rounds, greedy_guess_matches

SLOTS = 4
"""Block slots whose teacher-forced accuracy is reported (fewer for a smaller block)."""


@torch.no_grad()
def target_confidence(
    target: TargetModel, prompt: Sequence[int], output: Sequence[int], params: SamplingParams
) -> torch.Tensor:
    """Top-1 probability of the distribution each output token was decoded
    from: one forward over prompt + output, penalised as decoding penalised it."""
    logits = target.forward_sequences(torch.tensor([[*prompt, *output]])).logits
    logits = logits[:, len(prompt) - 1 : -1].float()  # the positions that predicted each output token
    history = TokenHistory.from_prompts([prompt], logits.shape[-1], logits.device)
    logits = penalize(logits, [params], history, drafts=torch.tensor([list(output[:-1])], dtype=torch.long))
    return logits.softmax(-1).amax(-1)[0]


def diagnose(
    target: TargetModel,
    draft: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    params: SamplingParams,
) -> dict[str, Any]:
    """Target confidence, teacher-forced slot accuracy and simulated tau over
    greedy ``outputs`` of ``prompts`` (outputs shorter than 2 tokens skipped)."""
    slots = min(SLOTS, draft.block_size - 1)
    confidence, hits, counted, rounds = [], torch.zeros(slots), torch.zeros(slots), []
    for prompt, output in zip(prompts, outputs, strict=True):
        if len(output) < 2:
            continue
        confidence.append(target_confidence(target, prompt, output, params))
        matches = greedy_guess_matches(draft, target, [*prompt, *output], len(prompt))
        # Slot k of the block at response position i has a label while i + k < len(output).
        remaining = torch.arange(len(output) - 1, 0, -1)[:, None]
        labelled = remaining >= torch.arange(1, slots + 1)
        hits += (matches[:, :slots] & labelled).sum(0)
        counted += labelled.sum(0)
        rounds += chain_rounds(matches)
    if not rounds:
        raise ValueError("no output of at least 2 tokens to diagnose")
    top1 = torch.cat(confidence)
    return {
        "target_top1_mean": top1.mean().item(),
        "target_top1_below_half": (top1 < 0.5).float().mean().item(),
        "teacher_forced_accuracy": (hits / counted.clamp(min=1)).tolist(),
        "simulated_tau": (sum(rounds) + len(rounds)) / len(rounds),
        "simulated_slot1_acceptance": sum(n > 0 for n in rounds) / len(rounds),
    }


def print_diagnosis(dataset: str, diagnosis: dict[str, Any]) -> None:
    """One human-readable line per dataset (``measured_tau``: greedy batch-1
    tau at the draft's block, when benchmarked)."""
    accuracy = diagnosis["teacher_forced_accuracy"]
    measured = diagnosis.get("measured_tau")
    print(
        f"{dataset:<10} target top-1 p {diagnosis['target_top1_mean']:.2f} "
        f"(< 0.5 for {diagnosis['target_top1_below_half']:.0%} of tokens); "
        f"draft teacher-forced slots 1-{len(accuracy)} {' / '.join(f'{a:.2f}' for a in accuracy)}; "
        f"simulated tau {diagnosis['simulated_tau']:.2f} "
        f"(slot-1 acceptance {diagnosis['simulated_slot1_acceptance']:.2f}), "
        f"measured {'-' if measured is None else f'{measured:.2f}'}"
    )
