"""Benchmark measurements: DFlash at several block sizes against target-only
decoding in the same process and run, plus transformers' assisted generation
and prompt-lookup decoding as peers on the same target."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import PreTrainedModel

from speculative.decode import DecodeConfig, GenerationResult, spec_generate
from speculative.draft import DFlashDraftModel
from speculative.sampling import SamplingParams
from speculative.target import TargetModel

if TYPE_CHECKING:
    from transformers import GenerationMixin


@dataclass(frozen=True)
class BenchSettings:
    """What to sweep. Block size 1 (target-only) always runs as the baseline.
    ``repetition_penalty`` (1: off) applies to every method alike."""

    block_sizes: tuple[int, ...] = (4, 8, 16)
    batch_sizes: tuple[int, ...] = (1,)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 128
    seed: int = 0
    repetition_penalty: float = 1.0


def distinct_ngram_ratio(sequences: Sequence[Sequence[int]], n: int = 4) -> float:
    """Distinct n-grams / all n-grams over the outputs (1.0: no repetition; a
    looping output drives it towards 0). Acceptance on a loop means little, so
    this is reported next to every tau."""
    total, distinct = 0, 0
    for tokens in sequences:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        distinct += len(set(grams))
    return distinct / total if total else 1.0


def run_dflash(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompts: Sequence[list[int]],
    block_size: int,
    batch_size: int,
    temperature: float,
    settings: BenchSettings,
    stop_token_ids: tuple[int, ...],
) -> dict[str, Any]:
    """Decode every prompt (in batches) and return throughput and acceptance."""
    config = DecodeConfig(block_size=block_size, max_new_tokens=settings.max_new_tokens, stop_token_ids=stop_token_ids)
    merged = GenerationResult(tokens=[], finish_reasons=[])
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        sampling = [
            SamplingParams(temperature, seed=settings.seed + i + j, repetition_penalty=settings.repetition_penalty)
            for j in range(len(chunk))
        ]
        result = spec_generate(target, draft, chunk, config, sampling)
        merged.tokens += result.tokens
        merged.rounds += result.rounds
    seconds = time.perf_counter() - start
    accepted = [sum(r.accepted_per_position[k] for r in merged.rounds) for k in range(block_size - 1)]
    verified = [sum(r.verified_per_position[k] for r in merged.rounds) for k in range(block_size - 1)]
    tokens = sum(len(t) for t in merged.tokens)
    return {
        "block_size": block_size,
        "batch_size": batch_size,
        "temperature": temperature,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tau": merged.mean_acceptance_length,
        "acceptance_per_position": [a / v if v else 0.0 for a, v in zip(accepted, verified, strict=True)],
        "distinct_4gram": distinct_ngram_ratio(merged.tokens),
        "outputs": merged.tokens,
    }


def run_hf_generate(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    temperature: float,
    settings: BenchSettings,
    stop_token_ids: tuple[int, ...],
    **generate_kwargs: object,
) -> dict[str, Any]:
    """transformers ``generate`` at batch 1 (plain, assisted or prompt lookup)."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    outputs, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        torch.manual_seed(settings.seed + i)
        ids = torch.tensor([prompt], device=model.device)
        # Every causal LM of transformers mixes in GenerationMixin (PreTrainedModel does not declare it).
        out = cast("GenerationMixin", model).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=list(stop_token_ids) or None,
            pad_token_id=stop_token_ids[0] if stop_token_ids else 0,
            repetition_penalty=settings.repetition_penalty,
            **{"do_sample": False, **sampling, **generate_kwargs},
        )
        outputs.append(out[0, len(prompt) :].tolist())
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "outputs": outputs,
        "distinct_4gram": distinct_ngram_ratio(outputs),
    }
