"""The native engine: continuous batching, stops, aborts, back-pressure,
draining and the block-size policy, on the tiny pipeline model and tokenizer."""

import asyncio
import os
import threading

import pytest
import torch

from service.engine import (
    BlockPolicy,
    EngineStoppedError,
    GenerateRequest,
    InvalidRequestError,
    NativeEngine,
    NativeEngineConfig,
    QueueFullError,
)
from service.engine.native_config import decode_threads, usable_cpus
from speculative.batch import prefill_groups
from speculative.decode import DecodeConfig, spec_generate
from speculative.sampling import SamplingParams
from speculative.session import DecodeSession


def prompts(n: int) -> list[tuple[int, ...]]:
    return [tuple(10 + (7 * i + j) % 200 for j in range(3 + i % 5)) for i in range(n)]


def greedy(target, prompt, n):
    return spec_generate(target, None, [list(prompt)], DecodeConfig(block_size=1, max_new_tokens=n)).tokens[0]


async def collect(engine, request):
    deltas = [d async for d in engine.generate(request)]
    ids = [t for d in deltas for t in d.token_ids]
    return deltas, ids, "".join(d.text for d in deltas)


def run(engine, coro):
    engine.start()
    try:
        return asyncio.run(coro)
    finally:
        engine.stop()


def collect_queued(engine, requests, finished: list[str] | None = None) -> list:
    """Queue every request before the scheduler starts (its admission then
    sees them all at once), run them; each one's ``collect`` result, in
    request order. ``finished`` gets the request ids in finishing order."""

    async def one(request):
        result = await collect(engine, request)
        if finished is not None:
            finished.append(request.request_id)
        return result

    async def main():
        calls = [asyncio.create_task(one(r)) for r in requests]
        for _ in range(6000):
            if engine.stats().waiting == len(requests):
                break
            await asyncio.sleep(0.01)
        engine.start()
        return await asyncio.gather(*calls)

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def run_queued(engine, requests) -> list[tuple[str, list[int]]]:
    """``collect_queued``'s (request id, token ids) in finishing order."""
    finished: list[str] = []
    results = dict(zip((r.request_id for r in requests), collect_queued(engine, requests, finished), strict=True))
    return [(key, results[key][1]) for key in finished]


@pytest.mark.parametrize(("branches", "lookup"), [(1, 0), (4, 0), (4, 6)])
def test_concurrent_requests_get_their_greedy_tokens_and_text(pair, branches, lookup, monkeypatch):
    target, draft, tokenizer = pair
    widths = []
    forward = target.forward

    def spy(ids, *args, **kwargs):
        if kwargs.get("block_visible") is not None:  # a tree round's verify block
            widths.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    config = NativeEngineConfig(max_batch_size=3, policy=BlockPolicy.fixed(8), branches=branches, lookup=lookup)
    engine = NativeEngine(target, draft, tokenizer, config)
    requests = [GenerateRequest(f"r{i}", p, max_tokens=10 + 3 * i) for i, p in enumerate(prompts(7))]

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    results = run(engine, main())
    for request, (deltas, ids, text) in zip(requests, results, strict=True):
        assert ids == greedy(target, request.prompt_ids, request.max_tokens)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == request.max_tokens
        assert deltas[-1].prompt_tokens == len(request.prompt_ids)
        assert deltas[-1].spec.rounds > 0 and deltas[-1].spec.acceptance_length >= 1
    assert engine.session.batch is None and engine.stats().running == 0
    # Verify blocks: the chain, then the first slot's alternates, then lookup continuations when found.
    chain_and_alternates = 8 + branches - 1
    assert (chain_and_alternates in widths) == (branches > 1)
    assert any(chain_and_alternates < w <= chain_and_alternates + lookup for w in widths) == (lookup > 0)
    assert max(widths, default=8) <= chain_and_alternates + lookup


def test_stop_token_and_stop_string(pair):
    target, draft, tokenizer = pair
    prompt = prompts(1)[0]
    reference = greedy(target, prompt, 30)
    stop_id = reference[6]
    full_text = tokenizer.decode(reference, skip_special_tokens=True)
    stop_text = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    engine = NativeEngine(target, draft, tokenizer)

    async def main():
        by_id = await collect(engine, GenerateRequest("a", prompt, 30, stop_token_ids=(stop_id,)))
        by_text = await collect(engine, GenerateRequest("b", prompt, 30, stop=(stop_text,)))
        return by_id, by_text

    (deltas, ids, _), (text_deltas, _, text) = run(engine, main())
    assert ids == reference[: reference.index(stop_id) + 1] and deltas[-1].finish_reason == "stop"
    assert text == full_text[: full_text.index(stop_text)] and text_deltas[-1].finish_reason == "stop"


def test_abandoned_stream_frees_its_slot(pair):
    target, draft, tokenizer = pair
    steps = []
    engine = NativeEngine(target, draft, tokenizer, on_step=lambda s, *_: steps.append(s))

    async def main():
        stream = engine.generate(GenerateRequest("gone", prompts(1)[0], 1500))
        async for _ in stream:
            break  # the client disconnects after the first delta
        await stream.aclose()
        for _ in range(200):
            if engine.stats().running == 0 and len(engine.session) == 0:
                # Freed long before 1500 tokens (>= 188 rounds of at most 8) were made.
                return len(steps) < 100
            await asyncio.sleep(0.01)
        return False

    assert run(engine, main())


def test_full_queue_is_refused_and_draining_refuses_new_work(pair):
    target, draft, tokenizer = pair
    engine = NativeEngine(target, draft, tokenizer, NativeEngineConfig(max_batch_size=1, max_waiting=1))

    async def main():
        first = asyncio.create_task(collect(engine, GenerateRequest("1", prompts(1)[0], 60)))
        while engine.stats().running == 0:
            await asyncio.sleep(0.005)
        second = asyncio.create_task(collect(engine, GenerateRequest("2", prompts(2)[1], 5)))
        while engine.stats().waiting == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(QueueFullError):
            await collect(engine, GenerateRequest("3", prompts(3)[2], 5))
        return await first, await second

    (_, ids1, _), (_, ids2, _) = run(engine, main())
    assert len(ids1) == 60 and len(ids2) == 5
    with pytest.raises(EngineStoppedError):
        asyncio.run(collect(engine, GenerateRequest("4", prompts(1)[0], 5)))


def test_drain_finishes_in_flight_requests(pair):
    target, draft, tokenizer = pair
    engine = NativeEngine(target, draft, tokenizer)
    engine.start()

    async def main():
        task = asyncio.create_task(collect(engine, GenerateRequest("d", prompts(1)[0], 40)))
        while engine.stats().running == 0:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.stop, True)
        return await task

    deltas, ids, _ = asyncio.run(main())
    assert len(ids) == 40 and deltas[-1].finish_reason == "length"


def test_policy_picks_the_block_size_per_batch_size(pair):
    target, draft, tokenizer = pair
    seen = []
    engine = NativeEngine(
        target, draft, tokenizer, NativeEngineConfig(max_batch_size=4), on_step=lambda s, *_: seen.append(s)
    )
    engine.set_policy(BlockPolicy(min_batch=(1, 3), block_sizes=(8, 1)))
    with pytest.raises(ValueError):
        engine.set_policy(BlockPolicy.fixed(9))
    lengths = [6, 12, 30, 40]  # the batch shrinks from 4 rows to 1 as requests finish
    requests = [GenerateRequest(f"p{i}", p, n) for i, (p, n) in enumerate(zip(prompts(4), lengths, strict=True))]

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    results = run(engine, main())
    for request, (_, ids, _) in zip(requests, results, strict=True):
        assert ids == greedy(target, request.prompt_ids, request.max_tokens)
    assert {(s.batch_size >= 3, s.block_size) for s in seen} <= {(True, 1), (False, 8)}
    assert any(s.block_size == 1 for s in seen) and any(s.block_size == 8 for s in seen)


def test_a_paired_policy_alternates_blocks_step_by_step_losslessly(pair):
    target, draft, tokenizer = pair
    seen = []
    engine = NativeEngine(target, draft, tokenizer, on_step=lambda s, *_: seen.append(s.block_size))
    engine.set_policy(BlockPolicy((1,), (4,), (1,)))  # a controller trial: b = 4 in turns with plain decoding
    request = GenerateRequest("p", prompts(1)[0], 30)
    _, ids, _ = run(engine, collect(engine, request))
    assert ids == greedy(target, request.prompt_ids, request.max_tokens)
    assert len(seen) > 4 and seen == [4, 1] * (len(seen) // 2) + [4] * (len(seen) % 2)


def test_every_nth_drafting_step_is_a_plain_reference_step_losslessly(pair):
    """plain_reference_every = 3: drafting steps 3, 6, 9, ... run at b = 1 (the
    achieved speedup's reference), and the output is still the target's."""
    target, draft, tokenizer = pair
    seen = []
    config = NativeEngineConfig(policy=BlockPolicy.fixed(4), plain_reference_every=3)
    engine = NativeEngine(target, draft, tokenizer, config, on_step=lambda s, *_: seen.append(s.block_size))
    request = GenerateRequest("p", prompts(1)[0], 30)
    _, ids, _ = run(engine, collect(engine, request))
    assert ids == greedy(target, request.prompt_ids, request.max_tokens)
    assert len(seen) > 6 and seen == [4, 4, 1] * (len(seen) // 3) + [4, 4][: len(seen) % 3]
    # A sampled row's draws depend on the blocks: with one in the batch no reference step runs.
    seen.clear()
    engine = NativeEngine(target, draft, tokenizer, config, on_step=lambda s, *_: seen.append(s.block_size))
    sampled = GenerateRequest("s", prompts(1)[0], 30, SamplingParams(0.8, seed=3))
    run(engine, collect(engine, sampled))
    assert len(seen) > 6 and set(seen) == {4}
    with pytest.raises(ValueError, match="plain_reference_every"):
        NativeEngineConfig(plain_reference_every=-1)


def test_requests_beyond_the_context_are_invalid(pair):
    target, draft, tokenizer = pair
    engine = NativeEngine(target, draft, tokenizer)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        asyncio.run(collect(engine, GenerateRequest("x", (5,) * 2000, 100)))
    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(collect(engine, GenerateRequest("y", (), 10)))


def test_two_engines_may_share_one_target(pair):
    """Feature captures are per thread, so engines on one target do not mix rows."""
    target, draft, tokenizer = pair
    engines = [NativeEngine(target, draft, tokenizer), NativeEngine(target, None, tokenizer)]
    requests = [GenerateRequest(f"s{i}", p, 30) for i, p in enumerate(prompts(6))]

    async def main():
        return await asyncio.gather(*(collect(engines[i % 2], r) for i, r in enumerate(requests)))

    for engine in engines:
        engine.start()
    try:
        results = asyncio.run(main())
    finally:
        for engine in engines:
            engine.stop()
    for request, (_, ids, _) in zip(requests, results, strict=True):
        assert ids == greedy(target, request.prompt_ids, 30)


def test_engine_registry():
    from service.engine import engine_class

    assert engine_class("native") is NativeEngine
    with pytest.raises(ValueError, match="unknown engine"):
        engine_class("tgi")


def test_requests_being_prefilled_count_against_the_queue_limit(pair):
    """With 4 rows and 4 waiting places, 8 requests are accepted at most, also
    while the first ones are being prefilled (they once did not count: 11 of 40
    got in)."""
    target, draft, tokenizer = pair
    entered, release = threading.Event(), threading.Event()

    class HeldPrefill(DecodeSession):
        def add(self, keys, prompts, sampling):
            entered.set()
            release.wait(60)
            return super().add(keys, prompts, sampling)

    engine = NativeEngine(target, draft, tokenizer, NativeEngineConfig(max_batch_size=4, max_waiting=4))
    engine.session = HeldPrefill(target, draft)

    async def main():
        tasks = [asyncio.create_task(collect(engine, GenerateRequest(f"a{i}", prompts(4)[i], 3))) for i in range(4)]
        await asyncio.to_thread(entered.wait, 60)  # the first four are in their prefill
        later = [asyncio.create_task(collect(engine, GenerateRequest(f"b{i}", prompts(1)[0], 3))) for i in range(36)]
        await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(*tasks, *later, return_exceptions=True)

    results = run(engine, main())
    accepted = [r for r in results if not isinstance(r, BaseException)]
    assert len(accepted) == 8 and all(isinstance(r, QueueFullError) for r in results if r not in accepted)


def test_decoding_leaves_a_cpu_to_the_event_loop():
    assert decode_threads(0, cpus=2) == 1
    assert decode_threads(0, cpus=1) == 1
    assert decode_threads(0, cpus=16) == 15
    assert decode_threads(3, cpus=2) == 3  # asked for: taken as given


def test_a_container_cpu_limit_caps_the_usable_cpus(tmp_path):
    everything = usable_cpus(tmp_path / "absent")  # no cgroup v2 CPU controller: the affinity mask
    assert everything == len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    for written, expected in [("max 100000", everything), ("50000 100000", 1), ("150000 100000", min(2, everything))]:
        cpu_max.write_text(written + "\n")
        assert usable_cpus(cpu_max) == expected


def test_the_scheduler_decodes_with_the_configured_threads(pair):
    target, draft, tokenizer = pair
    seen: list[int] = []
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    engine = NativeEngine(
        target,
        draft,
        tokenizer,
        NativeEngineConfig(threads=wanted),
        on_step=lambda *_: seen.append(torch.get_num_threads()),
    )
    try:
        _, ids, _ = run(engine, collect(engine, GenerateRequest("t", prompts(1)[0], max_tokens=6)))
    finally:
        torch.set_num_threads(before)  # torch's setting is process-wide: leave the other tests theirs
    assert ids == greedy(target, prompts(1)[0], 6)
    assert seen and set(seen) == {wanted}


def test_a_call_s_many_choices_share_the_batch_with_a_later_call(pair):
    """Admission is fair across groups (one API call's choices): with two batch
    places, four equal choices of one call and a single later request all
    queued, the batch takes one choice and the later request, not two choices
    (first come, first served would finish it last)."""
    target, draft, tokenizer = pair
    engine = NativeEngine(target, draft, tokenizer, NativeEngineConfig(max_batch_size=2, policy=BlockPolicy.fixed(4)))
    prompt = prompts(1)[0]
    requests = [*(GenerateRequest(f"a{i}", prompt, 24, group="a") for i in range(4)), GenerateRequest("b", prompt, 24)]
    finished = [key for key, _ in run_queued(engine, requests)]
    assert set(finished[:2]) == {"a0", "b"} and sorted(finished[2:]) == ["a1", "a2", "a3"]


def test_prefill_groups_split_prompts_by_length_where_padding_costs_more_than_a_forward():
    assert prefill_groups([20, 22, 19], forward_tokens=128) == [[2, 0, 1]]
    # Three short prompts and a long one: the short ones first, in a forward of their own.
    assert prefill_groups([250, 16, 12, 16], forward_tokens=128) == [[2, 1, 3], [0]]
    # Saving 2 x 110 padded tokens does not pay for a second forward at 256.
    assert prefill_groups([120, 10, 10], forward_tokens=256) == [[1, 2, 0]]
    assert prefill_groups([5, 5, 5], forward_tokens=0) == [[0, 1, 2]]  # equal lengths never split
    assert prefill_groups([]) == []


def test_short_prompts_admitted_with_a_long_one_are_prefilled_first_and_apart(pair):
    """A 200-token prompt queued with three short ones: the short ones share a
    forward of their own, before the long one's, and every request decodes the
    target's greedy tokens."""
    target, draft, tokenizer = pair
    config = NativeEngineConfig(max_batch_size=4, policy=BlockPolicy.fixed(4), prefill_chunk=0)
    engine = NativeEngine(target, draft, tokenizer, config)
    forwards = []
    original = engine.session.add

    def add(keys, prompt_ids, sampling):
        forwards.append(sorted(keys))
        return original(keys, prompt_ids, sampling)

    engine.session.add = add
    long = tuple(10 + (11 * j) % 200 for j in range(200))
    queued = [long, *prompts(3)]
    requests = [GenerateRequest(f"r{i}", p, 5) for i, p in enumerate(queued)]
    results = collect_queued(engine, requests)
    assert forwards == [["r1", "r2", "r3"], ["r0"]]
    for (_, ids, _), request in zip(results, requests, strict=True):
        assert ids == greedy(target, request.prompt_ids, 5)


@pytest.mark.parametrize("budget", [0, 250])
def test_a_request_that_would_pad_the_batch_past_its_slots_waits(pair, budget):
    """Two short requests and a 200-token one queued together, ``max_batch_slots``
    250: three rows padded to 200 tokens would hold 600 slots, so the long one is
    prefilled only once the short ones have left (without a budget it joins
    them); everyone decodes the target's greedy tokens."""
    target, draft, tokenizer = pair
    config = NativeEngineConfig(max_batch_size=4, policy=BlockPolicy.fixed(4), prefill_chunk=0, max_batch_slots=budget)
    engine = NativeEngine(target, draft, tokenizer, config)
    rows_at_add = {}
    original = engine.session.add

    def add(keys, prompt_ids, sampling):
        rows_at_add.update(dict.fromkeys(keys, len(engine.session)))
        return original(keys, prompt_ids, sampling)

    engine.session.add = add
    long = tuple(10 + (11 * j) % 200 for j in range(200))
    requests = [GenerateRequest(f"r{i}", p, 5) for i, p in enumerate([*prompts(2), long])]
    results = collect_queued(engine, requests)
    assert rows_at_add == {"r0": 0, "r1": 0, "r2": 0 if budget else 2}
    for (_, ids, _), request in zip(results, requests, strict=True):
        assert ids == greedy(target, request.prompt_ids, 5)


@pytest.mark.parametrize("chunk", [0, 4])
def test_rows_growing_past_the_slot_budget_are_preempted_and_resume_exactly(pair, chunk):
    """Three greedy requests and a seeded sampled one decoding 40 tokens under
    a 130-slot budget: they are admitted together (4 x (6 + 8) slots), and as
    they grow the latest admitted rows are preempted before each round would
    pass the budget, then rebuilt from their text (whole or in chunks) and
    resumed once rows have left. No round runs past the budget, and every
    request gets what it gets with no budget: the target's greedy tokens, the
    sampled one its draws alone."""
    target, draft, tokenizer = pair
    policy = BlockPolicy.fixed(4)
    budget = 130
    config = NativeEngineConfig(max_batch_size=4, policy=policy, prefill_chunk=chunk, max_batch_slots=budget)
    preempted = []
    engine = NativeEngine(target, draft, tokenizer, config, on_preempt=preempted.append)
    padded, step = [], engine.session.step

    def spy(b):
        padded.append(len(engine.session) * (int(engine.session.batch.lengths.max()) + 1 + draft.block_size))
        return step(b)

    engine.session.step = spy
    sampled = SamplingParams(temperature=0.8, seed=5)
    requests = [GenerateRequest(f"r{i}", p, 40) for i, p in enumerate(prompts(3))]
    requests.append(GenerateRequest("s", prompts(4)[3], 40, sampled))
    results = collect_queued(engine, requests)
    alone = NativeEngine(target, draft, tokenizer, NativeEngineConfig(policy=policy))
    ((_, sampled_alone, _),) = collect_queued(alone, [requests[-1]])
    assert sum(preempted) >= 2 and budget - 16 < max(padded) <= budget
    for (deltas, ids, text), request in zip(results, requests, strict=True):
        expected = sampled_alone if request.sampling.temperature else greedy(target, request.prompt_ids, 40)
        assert ids == expected and text == tokenizer.decode(ids, skip_special_tokens=True)
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 40
    assert engine.session.batch is None and engine.stats().running == engine.stats().waiting == 0


def test_a_preempted_request_resumes_before_requests_that_came_after_it(pair):
    """Three choices of one call decode plainly (a token a round, so the
    timeline is fixed) under a 120-slot budget; the third is preempted when the
    rows pass 24 tokens, and a new request arrives at that moment. When the
    first choice finishes, the preempted one resumes before the newcomer, even
    though fair admission favours a call with fewer rows in the batch, and only
    one of them fits beside the second choice."""
    target, draft, tokenizer = pair
    config = NativeEngineConfig(max_batch_size=4, policy=BlockPolicy.fixed(1), prefill_chunk=0, max_batch_slots=120)
    lengths = {"r0": 30, "r1": 40, "r2": 30}
    requests = [GenerateRequest(k, p, n, group="g") for (k, n), p in zip(lengths.items(), prompts(3), strict=True)]
    newcomer = GenerateRequest("new", prompts(4)[3], 10)
    arrived = threading.Event()
    holder: dict = {}

    def on_preempt(_count: int) -> None:  # on the scheduler thread, before the next admission
        if not arrived.is_set():
            holder["loop"].call_soon_threadsafe(holder["go"].set)
            arrived.wait(timeout=60)

    engine = NativeEngine(target, draft, tokenizer, config, on_preempt=on_preempt)
    order, prefill = [], engine._prefill
    engine._prefill = lambda jobs: (order.extend(job.request.request_id for job in jobs), prefill(jobs))[1]

    async def late():
        await holder["go"].wait()
        task = asyncio.create_task(collect(engine, newcomer))
        while engine.stats().waiting < 2:  # the preempted choice and the newcomer
            await asyncio.sleep(0.001)
        arrived.set()
        return await task

    async def main():
        holder["loop"], holder["go"] = asyncio.get_running_loop(), asyncio.Event()
        calls = [asyncio.create_task(collect(engine, r)) for r in requests]
        later = asyncio.create_task(late())
        while engine.stats().waiting < len(requests):
            await asyncio.sleep(0.01)
        engine.start()
        return await asyncio.gather(*calls, later)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert arrived.is_set() and order[:3] == ["r0", "r1", "r2"] and order[3:5] == ["r2", "new"]
    for (_, ids, _), request in zip(results, [*requests, newcomer], strict=True):
        assert ids == greedy(target, request.prompt_ids, request.max_tokens)


def test_a_lone_request_fits_any_slot_budget(pair):
    target, draft, tokenizer = pair
    config = NativeEngineConfig(max_batch_size=4, policy=BlockPolicy.fixed(4), prefill_chunk=0, max_batch_slots=1)
    ((_, ids, _),) = collect_queued(
        NativeEngine(target, draft, tokenizer, config), [GenerateRequest("r", prompts(1)[0], 5)]
    )
    assert ids == greedy(target, prompts(1)[0], 5)


def test_a_scored_prompt_is_prefilled_apart_from_the_others(pair):
    """Requests queued together, two asking for their prompts' log-probabilities
    (an echo's) and two not: the two kinds never share a prefill forward (the
    scored one computes the LM head at every position, which would slow the
    others' first token), every request decodes the target's greedy tokens, and
    only the scored ones get their prompts' log-probabilities."""
    target, draft, tokenizer = pair
    engine = NativeEngine(target, draft, tokenizer, NativeEngineConfig(max_batch_size=4, policy=BlockPolicy.fixed(4)))
    forwards = []
    original = engine.session.add

    def add(keys, prompt_ids, sampling):
        forwards.append({s.prompt_logprobs is not None for s in sampling})
        return original(keys, prompt_ids, sampling)

    engine.session.add = add
    queued = prompts(4)
    scoring = SamplingParams(prompt_logprobs=1)
    requests = [GenerateRequest(f"r{i}", p, 5, scoring if i % 2 else SamplingParams()) for i, p in enumerate(queued)]
    results = collect_queued(engine, requests)
    assert sorted(map(sorted, forwards)) == [[False], [True]]
    for (deltas, ids, _), request in zip(results, requests, strict=True):
        assert ids == greedy(target, request.prompt_ids, 5)
        scored = [s.token for s in deltas[0].prompt_logprobs]
        assert scored == (list(request.prompt_ids[1:]) if request.sampling.prompt_logprobs is not None else [])


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_an_idle_engine_gives_its_freed_heap_back_once_per_idle_spell(pair, delay):
    """``release_memory_after_s``: once the engine has sat idle that long after
    work it gives the heap back, once, not again until it has worked again; a
    request after the release decodes as before. 0: never."""
    target, draft, tokenizer = pair
    config = NativeEngineConfig(policy=BlockPolicy.fixed(4), release_memory_after_s=delay)
    engine = NativeEngine(target, draft, tokenizer, config)
    releases: list[float] = []
    engine._release_heap = lambda: releases.append(delay)

    async def releases_after_idling(expected):
        for _ in range(3000):  # the release comes within a delay of idleness; a busy machine may take longer
            if len(releases) >= expected:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # ten delays more: no second release within the same idle spell
        return len(releases)

    async def main():
        seen = []
        for i, prompt in enumerate(prompts(3)):
            seen.append(await releases_after_idling(i if delay else 0))
            _, ids, _ = await collect(engine, GenerateRequest(f"r{i}", prompt, 5))
            assert ids == greedy(target, prompt, 5)
        return seen

    assert run(engine, main()) == ([0, 1, 2] if delay else [0, 0, 0])


def test_glibc_offers_the_heap_release():
    import platform

    from service.engine.heap import heap_release

    release = heap_release()
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert release is not None
    release()
