"""Regeneration through transformers' ``generate`` in padded batches: the backend
for GPUs (``dflash-train data --backend generate --device cuda``).

On a GPU the continuous-batching session's per-row Python work costs more than
the padding it saves: one ``generate`` call over a thousand left-padded prompts
of similar length keeps the chip busy, and rows that finish early only idle
until their batch ends. Records are the session backend's (same fields, same
stop and length rules), so both feed the same trainers. ``generate`` takes one
sampling setting per call, so prompts are grouped by their temperature
(``row_sampling``); a sampled response depends on its batch, not on its index
alone, unlike the session backend's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from speculative.decode import cut_at_stop
from speculative.target import TargetModel

if TYPE_CHECKING:
    from speculative.train.regenerate import RegenerateConfig


def generate_batches(
    prompts: Mapping[int, Sequence[int]], temperature_of: Mapping[int, float], batch_size: int, seed: int
) -> list[list[int]]:
    """Prompt keys in batches of one temperature and similar lengths (little
    padding), the batches in a seeded random order: a run stopped early has
    answered a sample of the whole prompt mix, not just its shortest prompts."""
    batches = []
    for temperature in sorted(set(temperature_of.values())):
        keys = sorted((k for k in prompts if temperature_of[k] == temperature), key=lambda k: (len(prompts[k]), k))
        batches += [keys[i : i + batch_size] for i in range(0, len(keys), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] and attention mask [B, S], each row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def generate_stream(
    target: TargetModel,
    prompts: Mapping[int, Sequence[int]],
    stop_token_ids: tuple[int, ...],
    config: RegenerateConfig,
    temperature_of: Mapping[int, float],
    until: Callable[[], bool] = lambda: False,
) -> Iterator[dict[str, Any]]:
    """Yield one record per prompt, a batch at a time (fields as
    ``regenerate_stream``'s); ``temperature_of``: each prompt's temperature;
    no further batch starts once ``until()`` is true."""
    device = target.device
    for batch in generate_batches(prompts, temperature_of, config.batch_size, config.seed):
        temperature = temperature_of[batch[0]]
        ids, mask = left_padded([prompts[k] for k in batch], stop_token_ids[0])
        # One seed per batch: generate draws for the whole batch from the global generator.
        torch.manual_seed(config.seed * 1_000_003 + batch[0])
        with torch.no_grad():
            out = target.model.generate(  # type: ignore[operator]  # transformers' generate is untyped here
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=config.max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=config.top_p if temperature > 0 else None,
                top_k=config.top_k if temperature > 0 else None,
                repetition_penalty=config.repetition_penalty,
                eos_token_id=list(stop_token_ids),
                pad_token_id=stop_token_ids[0],
            )
        for key, row in zip(batch, out[:, ids.shape[1] :].tolist(), strict=True):
            response, finish = cut_at_stop(row, config.max_new_tokens, stop_token_ids)
            yield {
                "id": key,
                "prompt_ids": list(prompts[key]),
                "response_ids": response,
                "finish_reason": finish or "length",
                "temperature": temperature,
            }
        if until():  # checked after a batch: every run makes progress
            return
