"""The achieved speedup: output tokens per second of serving step time over
plain decoding's at the same batch bucket, from raw counters (the PromQL and
the Python reading of a ``/metrics`` page agree; the live comparison against a
plain-decoding run is in test_prometheus.py)."""

import asyncio
import time

import pytest

from service.engine import NativeEngine, NativeEngineConfig
from service.engine.types import GenerateRequest
from service.metrics import (
    Metrics,
    achieved_speedup,
    counters_between,
    overall_achieved_speedup,
    speedup_counters,
)
from speculative.policy import BlockPolicy
from speculative.session import RoundStats


def step(batch: int, block: int, accepted: list[int]) -> RoundStats:
    return RoundStats(batch, block, [], accepted, [batch] * (block - 1), 0.0, 0.0)


def page(metrics: Metrics) -> dict:
    return speedup_counters(metrics.render(0, 0).decode())


def test_the_speedup_compares_output_per_step_second_with_plain_steps_of_the_bucket():
    metrics = Metrics()
    for _ in range(10):  # plain decoding at batch 1: 1 token per 10 ms = 100 tokens/s
        metrics.observe_step(step(1, 1, []), 0.010)
    for _ in range(5):  # b = 4 at batch 1: 2 drafts accepted + the bonus per 20 ms = 150 tokens/s
        metrics.observe_step(step(1, 4, [1, 1, 0]), 0.020)
    for _ in range(4):  # batch 2-3 without plain steps: no reference, no speedup
        metrics.observe_step(step(2, 4, [2, 1, 0]), 0.020)
    counters = page(metrics)
    assert achieved_speedup(counters) == pytest.approx({"1": (10 + 15) / (0.1 + 0.1) / 100})
    assert overall_achieved_speedup(counters) == pytest.approx(((10 + 15) / 100) / 0.2)


def test_without_plain_steps_the_start_up_profile_is_the_reference():
    metrics = Metrics()
    for _ in range(4):  # profiled plain steps: batch 2 in 8 ms = 250 tokens/s
        metrics.observe_profile_step(step(2, 1, []), 0.008)
    before = page(metrics)
    for _ in range(6):  # served b = 8 at batch 2: (3 + 1) x 2 tokens in 16 ms = 500 tokens/s
        metrics.observe_step(step(2, 8, [2, 2, 2, 0, 0, 0, 0]), 0.016)
    after = page(metrics)
    assert achieved_speedup(after) == pytest.approx({"2-3": 2.0})
    # Between two scrapes the served counters are differenced, the profile kept whole.
    assert achieved_speedup(counters_between(before, after)) == pytest.approx({"2-3": 2.0})
    assert achieved_speedup(counters_between(after, after)) == {}
    metrics.observe_step(step(2, 1, []), 0.004)  # a served plain step replaces the profile's rate
    assert achieved_speedup(page(metrics)) == pytest.approx({"2-3": (48 + 2) / (0.096 + 0.004) / 500})


def test_prefills_cost_both_sides_the_same_seconds():
    """A prefill stalls every running row on either server: it adds the same
    seconds to what plain decoding would have taken and to what serving took,
    so it pulls the speedup towards 1, bucket by the batch size it leaves."""
    metrics = Metrics()
    for _ in range(10):  # plain decoding at batch 1: 100 tokens/s
        metrics.observe_step(step(1, 1, []), 0.010)
    for _ in range(10):  # b = 4 at batch 1: 3 tokens per 15 ms = 200 tokens/s
        metrics.observe_step(step(1, 4, [1, 1, 0]), 0.015)
    before = page(metrics)
    metrics.observe_prefill(1, 0.050)
    metrics.observe_prefill(3, 0.020)  # a bucket without steps: not in the speedup
    after = page(metrics)
    plain_needed, took = (10 + 30) / 100, 0.1 + 0.15
    assert achieved_speedup(before) == pytest.approx({"1": plain_needed / took})
    assert achieved_speedup(after) == pytest.approx({"1": (0.05 + plain_needed) / (0.05 + took)})
    assert overall_achieved_speedup(after) == pytest.approx((0.05 + plain_needed) / (0.05 + took))
    # Between two scrapes the prefill seconds are differenced like the step counters.
    assert counters_between(before, after)[("dflash_prefill_seconds", "", "1")] == pytest.approx(0.05)


def test_aggregated_steps_count_accepted_drafts_and_a_bonus_per_row():
    """SGLang's schedulers report steps in sums: each row commits its accepted
    drafts and the bonus token."""
    metrics = Metrics()
    metrics.observe_steps(step(4, 4, [6, 3, 1]), 0.5, steps=5)
    assert page(metrics)[("dflash_step_output_tokens", "4", "4-7")] == 6 + 3 + 1 + 4 * 5


def test_a_page_without_the_counters_has_no_speedup():
    assert achieved_speedup(speedup_counters("# TYPE other counter\nother_total 3.0\n")) == {}
    assert overall_achieved_speedup({}) is None


def test_the_engine_counts_only_the_tokens_requests_receive(pair):
    """A round may commit tokens past a request's length limit: the output
    counter has exactly the tokens the responses got (less each first token,
    which the prefill gives)."""
    target, draft, tokenizer = pair
    metrics = Metrics()
    config = NativeEngineConfig(policy=BlockPolicy.fixed(8))
    engine = NativeEngine(target, draft, tokenizer, config, on_step=metrics.observe_step)
    limits = (5, 9, 14)

    async def main() -> int:
        received = 0
        for n, max_tokens in enumerate(limits):
            async for delta in engine.generate(GenerateRequest(f"r{n}", (5 + n, 40, 41), max_tokens)):
                received += len(delta.token_ids)
        return received

    engine.start()
    try:
        received = asyncio.run(main())
    finally:
        engine.stop()
    output = sum(v for (name, _, _), v in page(metrics).items() if name == "dflash_step_output_tokens")
    assert received == sum(limits) and output == received - len(limits)


def test_the_engine_times_each_prefill_under_the_batch_it_leaves(pair):
    """Two requests arrive together: one prefill, filed under batch 2, that
    lasts at least the session's ``add`` (slowed here)."""
    target, draft, tokenizer = pair
    prefills = []
    config = NativeEngineConfig(policy=BlockPolicy.fixed(4))
    engine = NativeEngine(target, draft, tokenizer, config, on_prefill=lambda *a: prefills.append(a))
    add = engine.session.add

    def slower_add(*args):
        time.sleep(0.05)
        return add(*args)

    engine.session.add = slower_add

    async def one(n: int) -> None:
        async for _ in engine.generate(GenerateRequest(f"r{n}", (5 + n, 40, 41), 3)):
            pass

    async def main() -> None:
        requests = [asyncio.create_task(one(n)) for n in range(2)]
        await asyncio.sleep(0)  # both are queued before the scheduler starts
        engine.start()
        await asyncio.gather(*requests)

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert len(prefills) == 1
    batch, seconds = prefills[0]
    assert batch == 2 and seconds >= 0.05


def test_a_step_is_charged_its_whole_wall_time_not_only_its_forwards(pair):
    """Work the session does outside its two forwards (here a stand-in for
    cache compaction) is part of what a step costs the server."""
    target, draft, tokenizer = pair
    observed = []
    engine = NativeEngine(
        target, draft, tokenizer, NativeEngineConfig(policy=BlockPolicy.fixed(4)), on_step=lambda *a: observed.append(a)
    )
    step = engine.session.step

    def slower_step(block_size):
        time.sleep(0.05)  # outside the timed forwards, as compaction is
        return step(block_size)

    engine.session.step = slower_step

    async def main() -> None:
        async for _ in engine.generate(GenerateRequest("r", (5, 40, 41), 6)):
            pass

    engine.start()
    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert observed
    for stats, seconds, _ in observed:
        assert seconds >= 0.05 + stats.draft_seconds + stats.verify_seconds
