"""The start-up profile: time real decoding steps at a few batch sizes and
block sizes before serving, so the controller starts from measured step times
instead of only its prior (``dflash-serve --profile-startup``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from speculative.sampling import SamplingParams
from speculative.session import DecodeSession, RoundStats


def profile_step_times(
    session: DecodeSession,
    observe: Callable[[RoundStats, float], None],
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    block_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    prompt_tokens: int = 64,
    steps: int = 4,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Run ``steps`` rounds per (batch size, block size) on random prompts and
    report each step's stats and seconds to ``observe``. Acceptance on random
    prompts is meaningless: callers should record step times only.

    Per batch size the block sizes take turns step by step: a shared machine's
    speed drifts within seconds, and in turns the drift moves every block alike,
    so the shape of t(b) survives. Each block's first step is not reported: the
    first step at a new shape pays one-off costs (kernel selection, buffer
    growth). A step is charged its whole wall time by ``clock``, as the engine
    charges it. ``session`` must be empty and is left empty."""
    if len(session):
        raise ValueError("profile an idle session")
    generator = torch.Generator().manual_seed(seed)
    vocab = session.target.vocab_size
    blocks = [b for b in block_sizes if b <= session.max_block_size]
    for batch in batch_sizes:
        keys = [f"profile-{batch}-{i}" for i in range(batch)]
        prompts = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).tolist()
        session.add(keys, prompts, [SamplingParams()] * batch)
        try:
            for b in blocks:
                session.step(b)
            for _ in range(steps):
                for b in blocks:
                    started = clock()
                    stats, _ = session.step(b)
                    observe(stats, clock() - started)
        finally:
            session.remove(keys)
