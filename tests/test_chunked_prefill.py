"""A long prompt joins a busy engine a chunk at a time: the running requests
keep stepping between its chunks, everyone still gets the target's greedy
tokens, and a long prompt that fails or is abandoned mid-prefill harms no one."""

import asyncio
import itertools
import threading
import time

import pytest
import torch
from test_engine import collect, collect_queued, greedy, prompts, run, run_queued

from service.engine import GenerateRequest, NativeEngine, NativeEngineConfig
from speculative.policy import BlockPolicy
from speculative.sampling import SamplingParams

LONG = tuple(10 + (11 * j) % 300 for j in range(40))


def engine_with_events(pair, **config):
    """An engine that logs ("step", batch) and ("prefill", batch) in order."""
    target, draft, tokenizer = pair
    events: list[tuple[str, int]] = []
    engine = NativeEngine(
        target,
        draft,
        tokenizer,
        NativeEngineConfig(policy=BlockPolicy.fixed(4), **config),
        on_step=lambda stats, *_: events.append(("step", stats.batch_size)),
        on_prefill=lambda batch, _: events.append(("prefill", batch)),
    )
    return engine, events


async def until(condition, seconds: float = 60.0) -> None:
    """Wait for ``condition()`` (a failed test, not a hung one, if it never holds)."""
    for _ in range(int(seconds / 0.002)):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("timed out")


def hold(engine, method: str, holds: dict) -> None:
    """Call ``n`` of ``engine.session.<method>`` (0-based) first waits, on the
    scheduler thread, until ``holds[n]()``: the test acts at a known point of
    the schedule, however slowly its own event loop runs."""
    original, calls = getattr(engine.session, method), itertools.count()

    def held(*args):
        condition = holds.get(next(calls))
        deadline = time.monotonic() + 60.0
        while condition is not None and not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{method} held for 60 s")
            time.sleep(0.002)
        return original(*args)

    setattr(engine.session, method, held)


async def once_decoding(engine) -> None:
    """Until a row decodes (past its prefill: admitted alone counts as running)."""
    await until(lambda: len(engine.session) >= 1)


async def once_admitted(engine, requests: int) -> None:
    await until(lambda: engine.stats().running >= requests)


def long_beside_short(engine, short_tokens: int, long_tokens: int):
    """A short-prompt request runs; then LONG arrives (the short one's first
    step waits for it, so it is still decoding). Returns both (deltas, ids, text)."""
    hold(engine, "step", {0: lambda: engine.stats().waiting >= 1})

    async def main():
        short = asyncio.create_task(collect(engine, GenerateRequest("s", prompts(1)[0], short_tokens)))
        await once_decoding(engine)
        long = await collect(engine, GenerateRequest("l", LONG, long_tokens))
        return await short, long

    return run(engine, main())


def test_a_long_prompt_is_prefilled_between_the_running_requests_steps(pair):
    target = pair[0]
    engine, events = engine_with_events(pair, prefill_chunk=8)
    (_, short_ids, _), (_, long_ids, _) = long_beside_short(engine, 300, 30)
    assert short_ids == greedy(target, prompts(1)[0], 300)
    assert long_ids == greedy(target, LONG, 30)
    chunks = [i for i, event in enumerate(events) if event == ("prefill", 2)]
    assert len(chunks) == 5  # 40 tokens, 8 at a time, each filed under the 2 rows it held up
    assert all(("step", 1) in events[a:b] for a, b in itertools.pairwise(chunks))


def test_a_request_arriving_during_a_lone_long_prefill_waits_one_chunk(pair):
    """Nothing decodes, yet the long prompt still goes a chunk at a time: a
    request that arrives meanwhile joins after the next chunk, not after the
    whole prompt."""
    target = pair[0]
    engine, events = engine_with_events(pair, prefill_chunk=4)
    long_prompt = LONG * 2  # 20 chunks
    hold(engine, "prefill_chunk", {2: lambda: engine.stats().waiting >= 1})  # the third waits for the short one

    async def main():
        long = asyncio.create_task(collect(engine, GenerateRequest("l", long_prompt, 5)))
        await until(lambda: sum(e[0] == "prefill" for e in events) >= 2)
        short = await collect(engine, GenerateRequest("s", prompts(1)[0], 5))
        return await long, short

    (_, long_ids, _), (_, short_ids, _) = run(engine, main())
    assert long_ids == greedy(target, long_prompt, 5) and short_ids == greedy(target, prompts(1)[0], 5)
    prefills = [e for e in events if e[0] == "prefill"]
    assert len(prefills) == 21  # 20 chunks and the short prompt's prefill
    assert ("prefill", 2) in prefills  # chunks ran while the short request decoded: it joined between two


def test_a_request_abandoned_mid_prefill_frees_its_place(pair):
    target, _, _ = pair
    engine, events = engine_with_events(pair, prefill_chunk=2)
    long_prompt = LONG * 5  # 100 chunks
    left = threading.Event()
    hold(engine, "prefill_chunk", {2: left.is_set})  # still prefilling when its client leaves

    async def main():
        short = asyncio.create_task(collect(engine, GenerateRequest("s", prompts(1)[0], 400)))
        await once_decoding(engine)
        stream = engine.generate(GenerateRequest("gone", long_prompt, 10))
        pending = asyncio.create_task(anext(stream))
        await once_admitted(engine, 2)
        assert len(engine.session) == 1  # the long prompt is in its chunks, not yet a row
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()
        left.set()
        await until(lambda: engine.stats().running <= 1)
        freed_after = sum(e == ("prefill", 2) for e in events)
        _, ids, _ = await short
        return freed_after, ids

    freed_after, ids = run(engine, main())
    assert freed_after <= 4 and sum(e == ("prefill", 2) for e in events) == freed_after
    assert ids == greedy(target, prompts(1)[0], 400)
    assert engine.stats().running == 0 and len(engine.session) == 0


def test_a_chunk_that_fails_fails_only_its_request(pair, monkeypatch):
    target = pair[0]
    engine, _ = engine_with_events(pair, prefill_chunk=8)
    chunk = engine.session.prefill_chunk

    def failing(part, tokens):
        if part.done >= 16:
            raise RuntimeError("injected")
        return chunk(part, tokens)

    monkeypatch.setattr(engine.session, "prefill_chunk", failing)
    (_, short_ids, _), (long_deltas, long_ids, _) = long_beside_short(engine, 200, 10)
    assert short_ids == greedy(target, prompts(1)[0], 200)
    assert long_ids == [] and long_deltas[-1].finish_reason == "error"
    assert engine.stats().running == 0


def test_a_prompt_in_its_chunks_holds_a_batch_place(pair):
    """With two places, a running request and a long prompt in its chunks fill
    the batch: a third request waits while the chunks go on."""
    target = pair[0]
    engine, events = engine_with_events(pair, prefill_chunk=2, max_batch_size=2)
    long_prompt = LONG * 2  # 40 chunks

    def chunks() -> int:
        return sum(e == ("prefill", 2) for e in events)

    async def main():
        short = asyncio.create_task(collect(engine, GenerateRequest("s", prompts(1)[0], 300)))
        await once_decoding(engine)
        long = asyncio.create_task(collect(engine, GenerateRequest("l", long_prompt, 5)))
        await once_admitted(engine, 2)
        third = asyncio.create_task(collect(engine, GenerateRequest("t", prompts(2)[1], 5)))
        await until(lambda: engine.stats().waiting == 1)
        seen = chunks()
        await until(lambda: chunks() >= seen + 3)
        stats = engine.stats()
        held = (stats.running, stats.waiting, chunks() < 40)
        return held, await short, await long, await third

    held, *results = run(engine, main())
    assert held == (2, 1, True)
    assert [ids for _, ids, _ in results] == [
        greedy(target, prompts(1)[0], 300),
        greedy(target, long_prompt, 5),
        greedy(target, prompts(2)[1], 5),
    ]


def test_a_call_s_choices_share_one_chunked_prefill(pair):
    """Three choices of one long prompt (queued together, as an API call's
    ``n``) are prefilled a chunk at a time once, not three times, and each
    decodes the target's greedy tokens."""
    target, _, _ = pair
    engine, _ = engine_with_events(pair, prefill_chunk=8, max_batch_size=4)
    chunks = []
    original = engine.session.prefill_chunk
    engine.session.prefill_chunk = lambda part, size: chunks.append(part.done) or original(part, size)
    requests = [GenerateRequest(f"c{i}", LONG, 10, group="call") for i in range(3)]
    results = run_queued(engine, requests)
    assert chunks == [0, 8, 16, 24, 32]  # 40 tokens, 8 at a time, once
    assert [ids for _, ids in results] == [greedy(target, LONG, 10)] * 3


def test_a_chunked_prefill_scores_the_prompt_for_the_requests_that_ask(pair):
    """Prompt log-probabilities of a long prompt come chunk by chunk, on the
    first delta of the requests that ask, as one full forward gives them; a
    request with the same prompt that does not ask shares no prefill with them
    (it would pay for every position's logits) and gets none."""
    target, _, _ = pair
    engine, _ = engine_with_events(pair, prefill_chunk=8, max_batch_size=4)
    chunks = []
    original = engine.session.prefill_chunk
    engine.session.prefill_chunk = lambda part, size: chunks.append(part.done) or original(part, size)
    scoring = SamplingParams(prompt_logprobs=1)
    requests = [
        GenerateRequest("a", LONG, 6, scoring, group="call"),
        GenerateRequest("b", LONG, 6, scoring, group="call"),
        GenerateRequest("c", LONG, 6),
    ]
    results = collect_queued(engine, requests)
    assert sorted(chunks) == sorted([0, 8, 16, 24, 32] * 2)  # one prefill for a and b, one for c
    with torch.no_grad():
        reference = torch.log_softmax(target.model(torch.tensor([LONG])).logits[0, :-1].float(), dim=-1)
    for (deltas, ids, _), request in zip(results, requests, strict=True):
        assert ids == greedy(target, LONG, 6)
        scored = deltas[0].prompt_logprobs
        if request.sampling.prompt_logprobs is None:
            assert scored == () and all(d.prompt_logprobs == () for d in deltas)
            continue
        assert [s.token for s in scored] == list(LONG[1:])
        assert [s.logprob for s in scored] == pytest.approx(
            reference.gather(1, torch.tensor(LONG[1:])[:, None])[:, 0].tolist(), abs=1e-4
        )
        assert [s.top[0][0] for s in scored] == reference.argmax(-1).tolist()


def test_a_chunked_prefill_keeps_no_autograd_graph(pair):
    """The chunks run without autograd, as ``add`` and ``step`` do: with it, every
    chunk's activations stayed alive through the cache's graph until the row left
    (a 2,234-token SmolLM2 prompt grew the process by 2.7 GB) and the packed
    linears fell back to unpacked ones (docs/LOG.md)."""
    from speculative.session import DecodeSession

    target, draft, _ = pair
    session = DecodeSession(target, draft)
    part = session.start_prefill(LONG)
    while not session.prefill_chunk(part, 8):
        pass
    caches = [part.batch.target_cache, part.batch.draft_cache]
    assert part.last_logits is not None and not part.last_logits.requires_grad
    session.add_prefilled(["long"], part, [SamplingParams()])
    caches += [session.batch.target_cache, session.batch.draft_cache]
    for cache in caches:
        for layer in cache.layers:
            assert not layer.keys.requires_grad and not layer.values.requires_grad
