"""Fault isolation: a round or prefill that raises is rolled back and retried
on halves of the rows, so only the request that fails on its own gets an
error and every other request decodes exactly what it would have alone."""

import asyncio

import pytest
import torch
from faults import FaultySession
from test_engine import collect, prompts

from service.engine import BlockPolicy, GenerateRequest, NativeEngine, NativeEngineConfig
from speculative.sampling import SamplingParams
from speculative.session import DecodeSession

SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=7)
PENALISED = SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.5)


def faulty_engine(pair, poisoned: str | None = None, stage: str = "prefill", max_batch_size=8):
    """An engine whose session fails every prefill or round including ``poisoned``."""
    target, draft, tokenizer = pair
    engine = NativeEngine(target, draft, tokenizer, NativeEngineConfig(max_batch_size, policy=BlockPolicy.fixed(4)))
    hit = lambda keys, *_: poisoned in keys  # noqa: E731
    faults = {"fail_prefill": hit} if stage == "prefill" else {"fail_round": hit}
    engine.session = FaultySession(target, draft, **faults)
    return engine


def requests(n: int, max_tokens: int = 24) -> list[GenerateRequest]:
    sampling = [SamplingParams(), SEEDED, PENALISED]
    return [GenerateRequest(f"r{i}", p, max_tokens, sampling=sampling[i % 3]) for i, p in enumerate(prompts(n))]


def outputs(engine: NativeEngine, reqs: list[GenerateRequest]) -> dict[str, tuple[list[int], str]]:
    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(engine, r) for r in reqs)), timeout=120)

    engine.start()
    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    return {r.request_id: (ids, deltas[-1].finish_reason) for r, (deltas, ids, _) in zip(reqs, results, strict=True)}


@pytest.fixture(scope="module")
def alone(pair):
    """Each request's tokens decoded on its own."""
    return {r.request_id: outputs(faulty_engine(pair), [r])[r.request_id] for r in requests(6)}


@pytest.mark.parametrize("stage", ["prefill", "step"])
def test_a_failing_request_fails_alone(pair, alone, stage):
    engine = faulty_engine(pair, "r4", stage)
    got = outputs(engine, requests(6))
    ids, finish = got.pop("r4")
    assert finish == "error" and len(ids) == (0 if stage == "prefill" else 1)  # a prefill emits the first token
    assert got == {key: value for key, value in alone.items() if key != "r4"}
    assert engine.session.batch is None and engine.stats().running == 0 and engine.stats().waiting == 0


def test_a_round_that_raises_leaves_the_session_unchanged(pair):
    """Fail a round of a live session (after its cache appends and random
    draws), then run it: every row continues exactly as in a session that never
    failed; split and join give the same tokens too."""
    target, draft, _ = pair
    keys, batch_prompts = ["a", "b", "c"], [list(p) for p in prompts(3)]
    sampling = [SamplingParams(), SEEDED, PENALISED]
    poisoned = set()
    clean, faulty = (
        DecodeSession(target, draft),
        FaultySession(target, draft, fail_round=lambda keys: bool(poisoned & set(keys))),
    )
    for session in (clean, faulty):
        session.add(keys, batch_prompts, sampling)
    for step in range(6):
        if step in (1, 4):
            poisoned.add("b")
            with pytest.raises(RuntimeError):
                faulty.step(4)
            poisoned.clear()
        if step == 3:  # a round in two parts, then joined back
            part = faulty.split(["a", "c"])
            assert faulty.rows.keys == ["b"] and part.rows.keys == ["a", "c"]
            _, first = faulty.step(4)
            _, second = part.step(4)
            faulty.join(part)
            emitted = {**first, **second}
        else:
            _, emitted = faulty.step(4)
        _, expected = clean.step(4)
        assert emitted == expected
    assert torch.equal(faulty.batch.lengths.sort().values, clean.batch.lengths.sort().values)
