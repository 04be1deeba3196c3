"""Benchmark measurements: DFlash at several block sizes against target-only
decoding in the same process and run, plus transformers' assisted generation
and prompt-lookup decoding as peers on the same target."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from transformers import PreTrainedModel

from speculative.decode import DecodeConfig, GenerationResult, spec_generate
from speculative.draft import DFlashDraftModel
from speculative.sampling import SamplingParams
from speculative.target import TargetModel

if TYPE_CHECKING:
    from transformers import GenerationMixin

K = TypeVar("K")


@dataclass(frozen=True)
class BenchSettings:
    """What to sweep. Block size 1 (target-only) always runs as the baseline;
    every block size runs with each of ``branches`` (candidates verified for
    the first drafted slot, ``DecodeConfig.branches``) and each of ``lookups``
    (n-gram lookup tokens, ``DecodeConfig.lookup``), a lookup with each of
    ``lookup_tables`` (the draft's n-gram table on or off,
    ``DecodeConfig.lookup_table``). ``repetition_penalty``
    (1: off) applies to every method alike."""

    block_sizes: tuple[int, ...] = (4, 8, 16)
    branches: tuple[int, ...] = (1,)
    lookups: tuple[int, ...] = (0,)
    lookup_tables: tuple[bool, ...] = (False,)
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


def interleave(methods: Mapping[K, Callable[[int], None]], count: int) -> dict[K, float]:
    """Time every method on unit 0, then every method on unit 1, and so on, the
    order rotated by one per unit; returns each method's total seconds.

    A shared or throttled machine drifts by several percent within minutes. Run
    one after another, each method would get its own stretch of that drift and
    the speedups would carry it; taking turns unit by unit gives every method
    the same share of it."""
    names = list(methods)
    seconds = dict.fromkeys(names, 0.0)
    for unit in range(count):
        shift = unit % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            methods[name](unit)
            seconds[name] += time.perf_counter() - start
    return seconds


@dataclass(frozen=True)
class DFlashMethod:
    """One way to decode in the engine: block size 1 is target-only."""

    block_size: int
    branches: int = 1
    lookup: int = 0
    lookup_table: bool = False

    @property
    def name(self) -> str:
        """ "dflash b4", "dflash b4 k3" with three first-slot candidates, "dflash b4 k3 L8" with 8 lookup
        tokens, "dflash b4 k3 L8+table" continuing from the draft's n-gram table."""
        if self.block_size == 1:
            return "target-only"
        return " ".join(
            [f"dflash b{self.block_size}"]
            + ([f"k{self.branches}"] if self.branches > 1 else [])
            + ([f"L{self.lookup}" + ("+table" if self.lookup_table else "")] if self.lookup else [])
        )


TARGET_ONLY = DFlashMethod(1)


def sweep_methods(settings: BenchSettings) -> list[DFlashMethod]:
    """Target-only first, then every block size with every branches and lookup setting
    (a lookup with every table setting)."""
    return [
        TARGET_ONLY,
        *(
            DFlashMethod(b, k, n, table)
            for b in settings.block_sizes
            for k in settings.branches
            for n in settings.lookups
            for table in (settings.lookup_tables if n else (False,))
        ),
    ]


def run_dflash(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompts: Sequence[list[int]],
    methods: Sequence[DFlashMethod],
    batch_size: int,
    temperature: float,
    settings: BenchSettings,
    stop_token_ids: tuple[int, ...],
) -> dict[DFlashMethod, dict[str, Any]]:
    """Decode every prompt (in batches) with each method, the methods taking
    turns batch by batch (``interleave``); returns throughput and acceptance
    per method."""
    results = {m: GenerationResult(tokens=[], finish_reasons=[]) for m in methods}
    chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]

    def decode_at(method: DFlashMethod) -> Callable[[int], None]:
        config = DecodeConfig(
            block_size=method.block_size,
            max_new_tokens=settings.max_new_tokens,
            stop_token_ids=stop_token_ids,
            branches=method.branches,
            lookup=method.lookup,
            lookup_table=method.lookup_table,
        )

        def decode_chunk(index: int) -> None:
            first, penalty = index * batch_size, settings.repetition_penalty
            sampling = [
                SamplingParams(temperature, seed=settings.seed + first + j, repetition_penalty=penalty)
                for j in range(len(chunks[index]))
            ]
            result = spec_generate(target, draft if method.block_size > 1 else None, chunks[index], config, sampling)
            results[method].tokens += result.tokens
            results[method].rounds += result.rounds

        return decode_chunk

    seconds = interleave({m: decode_at(m) for m in methods}, len(chunks))
    return {m: _dflash_summary(results[m], m, batch_size, temperature, seconds[m]) for m in methods}


def _dflash_summary(
    merged: GenerationResult, method: DFlashMethod, batch_size: int, temperature: float, seconds: float
) -> dict[str, Any]:
    block_size = method.block_size
    accepted = [sum(r.accepted_per_position[k] for r in merged.rounds) for k in range(block_size - 1)]
    verified = [sum(r.verified_per_position[k] for r in merged.rounds) for k in range(block_size - 1)]
    tokens = sum(len(t) for t in merged.tokens)
    rows = sum(len(r.committed) for r in merged.rounds)
    return {
        "block_size": block_size,
        "branches": method.branches,
        "branch_share": sum(r.branches_taken for r in merged.rounds) / rows if rows else 0.0,
        "lookup": method.lookup,
        "lookup_tokens_per_round": sum(r.lookup_accepted for r in merged.rounds) / rows if rows else 0.0,
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
    methods: Mapping[str, Mapping[str, object]],
) -> dict[str, dict[str, Any]]:
    """transformers ``generate`` at batch 1, once per method (its extra
    ``generate`` arguments: plain, assisted or prompt lookup), the methods
    taking turns prompt by prompt (``interleave``)."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    outputs: dict[str, list[list[int]]] = {name: [] for name in methods}

    def generate_with(name: str) -> Callable[[int], None]:
        def generate_one(index: int) -> None:
            prompt = prompts[index]
            torch.manual_seed(settings.seed + index)
            ids = torch.tensor([prompt], device=model.device)
            # Every causal LM of transformers mixes in GenerationMixin (PreTrainedModel does not declare it).
            out = cast("GenerationMixin", model).generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=settings.max_new_tokens,
                eos_token_id=list(stop_token_ids) or None,
                pad_token_id=stop_token_ids[0] if stop_token_ids else 0,
                repetition_penalty=settings.repetition_penalty,
                **{"do_sample": False, **sampling, **methods[name]},
            )
            outputs[name].append(out[0, len(prompt) :].tolist())

        return generate_one

    seconds = interleave({name: generate_with(name) for name in methods}, len(prompts))
    return {name: _hf_summary(outputs[name], seconds[name]) for name in methods}


def _hf_summary(outputs: list[list[int]], seconds: float) -> dict[str, Any]:
    tokens = sum(len(o) for o in outputs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "outputs": outputs,
        "distinct_4gram": distinct_ngram_ratio(outputs),
    }
