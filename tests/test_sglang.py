"""The SGLang plugin's pure logic and the service's SGLang engine, on CPU.

SGLang itself cannot run here; the engine tests drive ``SGLangEngine`` with a
stand-in runtime that streams cumulative chunks the way ``sglang.Engine``
does (a unit in isolation)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.config import ServeSettings
from service.controller.source import observation_from_text
from service.engine import BlockPolicy, GenerateRequest, InvalidRequestError, QueueFullError
from service.engine.sglang import SGLangEngine, finish_reason, sampling_params, server_args, spec_stats
from service.metrics import Metrics
from speculative.policy import Turns, check_policy
from speculative.sampling import SamplingParams
from speculative.sglang import plugin
from speculative.sglang.logic import (
    ADAPTIVE_ENV,
    BLOCK_STATE_ATTRS,
    GRAPH_BLOCKS_ENV,
    AcceptCounters,
    BlockStateCache,
    StepCell,
    StepCounters,
    graph_block_sizes,
    resolve_algorithm,
    smallest_block_size,
    step_block_size,
)

# --------------------------------------------------------------------- policy


def test_policy_json_round_trip_and_errors():
    for policy in (BlockPolicy((1, 4, 16), (16, 8, 2)), BlockPolicy((1, 4, 16), (16, 8, 2), (16, 1, 2))):
        assert BlockPolicy.from_json(policy.to_json()) == policy
    assert BlockPolicy.fixed(4).to_dict() == {"min_batch": [1], "block_sizes": [4]}
    bad_alternates = (
        '{"min_batch": [1], "block_sizes": [4], "alternates": [1, 2]}',
        '{"min_batch": [1], "block_sizes": [4], "alternates": [0]}',
    )
    for bad in ("{", '{"min_batch": [1]}', '{"min_batch": [2], "block_sizes": [4]}', "[]", *bad_alternates):
        with pytest.raises(ValueError):
            BlockPolicy.from_json(bad)


def test_step_block_size_follows_the_table_within_bounds():
    policy = BlockPolicy((1, 4, 16), (16, 6, 1))
    assert [step_block_size(policy, bs, 16, Turns()) for bs in (1, 3, 4, 15, 16, 64)] == [16, 16, 6, 6, 2, 2]
    assert step_block_size(policy, 1, 8, Turns()) == 8  # never above the drafter's block
    assert step_block_size(BlockPolicy.fixed(4), 0, 16, Turns()) == 4  # an idle batch counts as 1
    # With plain steps on, b = 1 is verified as itself.
    assert [step_block_size(policy, bs, 16, Turns(), smallest=1) for bs in (1, 4, 16, 64)] == [16, 6, 1, 1]


@pytest.mark.parametrize(
    "plain_steps, argmax_draft, expected",
    [("1", True, 1), (None, True, 2), ("0", True, 2), ("1", False, 2)],  # selector / LiLiCorr / Domino drafts: 2
)
def test_plain_steps_only_when_asked_and_the_draft_drafts_by_argmax(plain_steps, argmax_draft, expected):
    assert smallest_block_size(plain_steps, argmax_draft) == expected


def test_a_range_with_an_alternate_takes_turns_within_its_own_steps():
    # The batch flips between the two ranges every step; one turn counter for
    # all ranges would run only the first block of range 1 (turns 0, 2, 4, ...).
    policy, turns = BlockPolicy((1, 4), (8, 1), (4, 1)), Turns()
    steps = [(batch, step_block_size(policy, batch, 16, turns)) for batch in [1, 5] * 4]
    assert [b for batch, b in steps if batch == 1] == [8, 4, 8, 4]
    assert [b for batch, b in steps if batch == 5] == [2, 2, 2, 2]  # SGLang's smallest block
    assert [policy.block_size(1, turn) for turn in range(3)] == [8, 4, 8]


def test_check_policy_rejects_blocks_above_the_draft():
    check_policy(BlockPolicy((1, 8), (16, 4)), 16)
    with pytest.raises(ValueError, match="exceed"):
        check_policy(BlockPolicy.fixed(32), 16)
    with pytest.raises(ValueError, match="exceed"):
        check_policy(BlockPolicy((1,), (4,), (32,)), 16)  # an alternate counts too


def test_adaptive_algorithm_name_maps_to_upstream_dflash():
    assert resolve_algorithm("DFLASH_ADAPTIVE") == ("DFLASH", True)
    assert resolve_algorithm("dflash_adaptive") == ("DFLASH", True)
    assert resolve_algorithm("DFLASH") == ("DFLASH", False)
    assert resolve_algorithm(None) == (None, False)


# ---------------------------------------------------------- per-block state


def _worker(block: int) -> SimpleNamespace:
    state = {name: object() for name in BLOCK_STATE_ATTRS}
    return SimpleNamespace(**{**state, "block_size": block})


def test_block_state_cache_swaps_and_restores_the_same_buffers():
    worker = _worker(16)
    original = {name: getattr(worker, name) for name in BLOCK_STATE_ATTRS}
    built = []

    def fresh(b):
        built.append(b)
        return {name: (b, name) for name in BLOCK_STATE_ATTRS} | {"block_size": b}

    cache = BlockStateCache(worker, fresh)
    assert not cache.activate(16)
    assert cache.activate(4) and worker.block_size == 4 and worker._out_tokens_bufs == (4, "_out_tokens_bufs")
    assert cache.activate(16)
    assert {name: getattr(worker, name) for name in BLOCK_STATE_ATTRS} == original  # identical objects back
    assert cache.activate(4) and worker._draft_block_ids_buf == (4, "_draft_block_ids_buf")
    assert built == [4]  # each block size built once; buffers of others stay alive


def test_block_state_cache_refuses_incomplete_state():
    cache = BlockStateCache(_worker(16), lambda b: {"block_size": b})
    with pytest.raises(ValueError, match="lacks"):
        cache.activate(8)


@pytest.mark.parametrize(
    "value, trained, expected",
    [
        (None, 16, (2, 3, 4, 6, 8, 10, 12, 16)),  # the controller's candidates, b = 1 verified as 2
        ("", 8, (2, 3, 4, 6, 8)),
        (None, 5, (2, 3, 4, 5)),  # the trained block always has graphs
        ("4, 8", 16, (4, 8, 16)),
        ("16", 16, (16,)),  # only upstream's set
    ],
)
def test_graph_block_sizes(value, trained, expected):
    assert graph_block_sizes(value, trained) == expected


def test_graph_block_sizes_with_plain_steps():
    assert graph_block_sizes(None, 16, smallest=1) == (1, 2, 3, 4, 6, 8, 10, 12, 16)
    assert graph_block_sizes("1,4", 16, smallest=1) == (1, 4, 16)


@pytest.mark.parametrize("value", ["1,4", "4,32", "four"])
def test_graph_block_sizes_refuses_blocks_never_run(value):
    with pytest.raises(ValueError, match=GRAPH_BLOCKS_ENV):
        graph_block_sizes(value, 16)


def test_step_counters_per_batch_and_block_size():
    counters = StepCounters()
    counters.add_step([3, 0], block_size=4, seconds=0.02)
    counters.add_step([1, 1], block_size=4, seconds=0.04, graph=True)
    counters.add_step([5], block_size=8, seconds=0.01)
    assert counters.cells[(2, 4)] == StepCell(2, pytest.approx(0.06), [3, 1, 1], graph_steps=1)
    assert counters.cells[(1, 8)] == StepCell(1, 0.01, [1, 1, 1, 1, 1, 0, 0])
    with pytest.raises(ValueError):
        counters.add_step([4], block_size=4, seconds=0.01)
    # Two data-parallel schedulers sum; a later report minus an earlier one is what is new.
    report = json.loads(json.dumps(counters.to_report()))
    doubled = StepCounters.from_reports([report, report])
    assert doubled.cells[(2, 4)] == StepCell(4, pytest.approx(0.12), [6, 2, 2], graph_steps=2)
    assert doubled.since(counters).cells == {
        (2, 4): StepCell(2, pytest.approx(0.06), [3, 1, 1], graph_steps=1),
        (1, 8): StepCell(1, 0.01, [1, 1, 1, 1, 1, 0, 0]),
    }
    assert counters.since(counters).cells == {}
    restarted = StepCounters()
    restarted.add_step([0], block_size=8, seconds=0.03)
    assert restarted.since(doubled).cells == {(1, 8): StepCell(1, 0.03, [0] * 7)}


def test_accept_counters_count_only_positions_each_step_verified():
    steps = StepCounters()
    steps.add_step([3, 0], block_size=4, seconds=0.0)  # positions 1..3 verified twice
    steps.add_step([7], block_size=8, seconds=0.0)  # positions 1..7 once
    counters = AcceptCounters.from_steps(steps, max_block_size=8)
    assert counters.verified_per_position == [3, 3, 3, 1, 1, 1, 1]
    assert counters.accepted_per_position == [2, 2, 2, 1, 1, 1, 1]
    assert (counters.rows, counters.drafted, counters.accepted) == (3, 13, 10)
    assert counters.acceptance_length == pytest.approx((10 + 3) / 3)
    with pytest.raises(ValueError):
        steps.add_step([4], block_size=4, seconds=0.0)


# ------------------------------------------------------------ plugin hooks


def test_rewrite_algorithm_marks_the_run_adaptive(monkeypatch):
    monkeypatch.delenv(ADAPTIVE_ENV, raising=False)
    args = SimpleNamespace(speculative_algorithm="DFLASH")
    plugin.rewrite_algorithm(args)
    assert args.speculative_algorithm == "DFLASH" and ADAPTIVE_ENV not in os.environ
    args = SimpleNamespace(speculative_algorithm="DFLASH_ADAPTIVE")
    assert plugin.rewrite_algorithm(args) is None  # a BEFORE hook keeps the call's arguments
    assert args.speculative_algorithm == "DFLASH" and os.environ[ADAPTIVE_ENV] == "1"


def test_worker_choice_is_upstream_unless_adaptive(monkeypatch):
    monkeypatch.delenv(ADAPTIVE_ENV, raising=False)
    upstream = object()
    dflash = SimpleNamespace(is_dflash=lambda: True)
    assert plugin.choose_worker(lambda algo, args: upstream, dflash, None) is upstream
    monkeypatch.setenv(ADAPTIVE_ENV, "1")
    eagle = SimpleNamespace(is_dflash=lambda: False)
    assert plugin.choose_worker(lambda algo, args: upstream, eagle, None) is upstream


def test_scheduler_rpcs_reach_the_adaptive_worker():
    class Scheduler:
        def __init__(self, worker):
            self.draft_worker = worker

    plugin.add_scheduler_rpcs(Scheduler)
    received = []
    adaptive = SimpleNamespace(set_block_policy=received.append)
    Scheduler(adaptive).dflash_set_policy(policy_json=BlockPolicy((1, 8), (16, 4)).to_json())
    Scheduler(adaptive).dflash_probe()
    assert received == [BlockPolicy((1, 8), (16, 4))]
    with pytest.raises(RuntimeError, match="not running"):
        Scheduler(SimpleNamespace()).dflash_probe()
    with pytest.raises(ValueError):
        Scheduler(adaptive).dflash_set_policy(policy_json="{}")


def test_internal_state_reports_policy_and_counters():
    steps = StepCounters()
    steps.add_step([2], 4, 0.5)
    worker = SimpleNamespace(
        block_policy=BlockPolicy.fixed(4),
        block_states=SimpleNamespace(active=4),
        step_counters=steps,
        trained_block_size=4,
    )
    state = {}
    plugin.report_state(None, SimpleNamespace(scheduler=SimpleNamespace(draft_worker=worker)), state)
    report = json.loads(json.dumps(state))["dflash_adaptive"]  # msgpack/JSON-native
    assert report["policy"] == {"min_batch": [1], "block_sizes": [4]} and report["active_block_size"] == 4
    assert report["accept"]["accepted_per_position"] == [1, 1, 0]
    assert StepCounters.from_reports([report["steps"]]) == steps
    plugin.report_state(None, SimpleNamespace(scheduler=SimpleNamespace(draft_worker=None)), empty := {})
    assert empty == {}


# ------------------------------------------------------- argument mapping


def test_server_and_sampling_arguments():
    settings = ServeSettings(target=Path("/m/target"), draft=Path("/m/draft"), max_batch_size=8, device="cuda")
    args = server_args(settings, 16)
    assert args["speculative_algorithm"] == "DFLASH_ADAPTIVE" and args["speculative_num_draft_tokens"] == 16
    assert args["max_running_requests"] == 8 and args["incremental_streaming_output"] is False
    assert "speculative_algorithm" not in server_args(ServeSettings(target=Path("/m/t"), draft=None), 1)
    flags = ["--draft", "/m/d", "--sglang-args", '{"tp_size": 2, "max_running_requests": 4}']
    extra = ServeSettings(_cli_parse_args=flags, _cli_kebab_case=True)
    args = server_args(extra, 16)
    assert args["tp_size"] == 2 and args["max_running_requests"] == 4 and args["speculative_num_draft_tokens"] == 16

    request = GenerateRequest("r", (1, 2), 5, SamplingParams(0.7, top_p=0.9, seed=3), (0,), ("\n\n",))
    assert sampling_params(request) == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "stop_token_ids": [0],
        "stop": ["\n\n"],
        "skip_special_tokens": True,
        "sampling_seed": 3,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
    }
    biased = GenerateRequest("r", (1, 2), 5, SamplingParams(logit_bias=((7, -100.0), (9, 2.0))))
    assert sampling_params(biased)["logit_bias"] == {"7": -100.0, "9": 2.0}  # SGLang's keys are strings
    assert "logit_bias" not in sampling_params(request)


def test_finish_reasons_and_spec_stats():
    assert finish_reason({"finish_reason": None}) is None
    assert finish_reason({"finish_reason": {"type": "length", "length": 5}}) == "length"
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == "stop"
    assert finish_reason({"finish_reason": {"type": "abort", "message": "x"}}) == "abort"
    stats = spec_stats({"spec_verify_ct": 4, "spec_num_proposed_drafts": 60, "spec_num_correct_drafts": 9})
    assert (stats.rounds, stats.drafted, stats.accepted, stats.acceptance_length) == (4, 60, 9, 13 / 4)
    assert spec_stats({}).rounds == 0


# ------------------------------------------------ engine on a stand-in runtime


class Letters:
    """Decoder stand-in: token i is chr(ord('a') + i)."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in token_ids)


class FakeRuntime:
    """Streams ``script`` as cumulative chunks like ``sglang.Engine.async_generate``."""

    def __init__(self, script: list[list[int]], final_meta: dict | None = None) -> None:
        self.script, self.final_meta = script, final_meta or {}
        self.aborted, self.rpcs, self.calls = [], [], []
        self.states: list[dict] = [{}]  # get_internal_state(): one dict per data-parallel scheduler

        async def internal_state():
            return self.states

        self.tokenizer_manager = SimpleNamespace(
            abort_request=lambda rid: self.aborted.append(rid), get_internal_state=internal_state
        )

    async def async_generate(self, **kwargs):
        self.calls.append(kwargs)

        async def chunks():
            for i, ids in enumerate(self.script):
                last = i == len(self.script) - 1
                meta = {
                    "id": kwargs["rid"],
                    "prompt_tokens": len(kwargs["input_ids"]),
                    "completion_tokens": len(ids),
                    "finish_reason": {"type": "length"} if last else None,
                }
                yield {"text": "", "output_ids": list(ids), "meta_info": meta | (self.final_meta if last else {})}
                await asyncio.sleep(0)

        return chunks()

    def collective_rpc(self, method, **kwargs):
        self.rpcs.append((method, kwargs))

    def shutdown(self):
        pass


def _engine(runtime, **overrides) -> SGLangEngine:
    options = dict(max_block_size=16, context_length=256, max_batch_size=2, max_waiting=0) | overrides
    return SGLangEngine(runtime, Letters(), **options)


async def _collect(engine, request, limit=None):
    deltas = []
    stream = engine.generate(request)
    async for delta in stream:
        deltas.append(delta)
        if limit and len(deltas) == limit:
            await stream.aclose()
            break
    return deltas


def test_cumulative_chunks_become_deltas():
    runtime = FakeRuntime([[0], [0, 1, 2], [0, 1, 2, 3]], {"spec_verify_ct": 2, "spec_num_correct_drafts": 2})
    engine = _engine(runtime)
    deltas = asyncio.run(_collect(engine, GenerateRequest("r1", (5, 6), 4)))
    assert [d.token_ids for d in deltas] == [(0,), (1, 2), (3,)]
    assert "".join(d.text for d in deltas) == "abcd"
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert deltas[-1].spec.acceptance_length == 2.0 and deltas[-1].prompt_tokens == 2
    assert runtime.calls[0]["input_ids"] == [5, 6] and runtime.calls[0]["stream"] is True
    assert runtime.aborted == [] and engine.stats().running == 0


def test_a_stop_string_ends_the_request_and_aborts_it_upstream():
    runtime = FakeRuntime([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]])
    deltas = asyncio.run(_collect(_engine(runtime), GenerateRequest("r2", (5,), 4, stop=("c",))))
    assert "".join(d.text for d in deltas) == "ab" and deltas[-1].finish_reason == "stop"
    assert runtime.aborted == ["r2"]


def test_leaving_early_aborts_and_frees_the_slot():
    runtime = FakeRuntime([[0], [0, 1], [0, 1, 2]])
    engine = _engine(runtime)
    deltas = asyncio.run(_collect(engine, GenerateRequest("r3", (5,), 3), limit=1))
    assert len(deltas) == 1 and runtime.aborted == ["r3"] and engine.stats().running == 0


def test_capacity_and_context_limits():
    engine = _engine(FakeRuntime([[0]]), max_batch_size=1, context_length=20)

    async def scenario():
        first = engine.generate(GenerateRequest("a", (1,), 1))
        await first.__anext__()  # admitted and streaming
        with pytest.raises(QueueFullError):
            await engine.generate(GenerateRequest("b", (1,), 1)).__anext__()
        await first.aclose()

    asyncio.run(scenario())
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        asyncio.run(_collect(engine, GenerateRequest("c", (1,) * 10, 8)))
    for sampling in (SamplingParams(logprobs=0), SamplingParams(prompt_logprobs=1)):  # the latter: an echo's
        with pytest.raises(InvalidRequestError, match="logprobs need the native engine") as info:
            asyncio.run(_collect(engine, GenerateRequest("d", (1,), 1, sampling)))
        assert info.value.param == "logprobs"


def test_policy_goes_to_every_scheduler_as_json():
    runtime = FakeRuntime([[0]])
    engine = _engine(runtime)
    policy = BlockPolicy((1, 8), (16, 4))
    engine.set_policy(policy)
    assert runtime.rpcs == [("dflash_set_policy", {"policy_json": policy.to_json()})]
    assert engine.policy == policy and engine.stats().block_size == 16
    with pytest.raises(ValueError):
        engine.set_policy(BlockPolicy.fixed(32))
    assert len(runtime.rpcs) == 1


def test_scheduler_step_counters_feed_the_metrics_the_controller_reads():
    runtime, metrics = FakeRuntime([[1]]), Metrics()
    engine = _engine(runtime, metrics=metrics, poll_interval_s=0.01)
    asyncio.run(engine.poll_steps())  # a plain SGLang run reports nothing of ours
    rank = StepCounters()
    rank.add_step([3, 1], block_size=4, seconds=0.02)
    runtime.states = [{"dflash_adaptive": {"steps": rank.to_report()}}] * 2  # two data-parallel schedulers
    asyncio.run(engine.poll_steps())
    value = metrics.registry.get_sample_value
    cell = {"block_size": "4", "batch_bucket": "2-3"}
    assert value("dflash_verify_steps_total", {"block_size": "4"}) == 2
    assert value("dflash_verify_rows_total", {"block_size": "4"}) == 4
    assert value("dflash_step_seconds_count", cell) == 2 and value("dflash_step_seconds_sum", cell) == pytest.approx(
        0.04
    )
    accepted = [value("dflash_accepted_tokens_per_position_total", {"position": str(k)}) for k in (1, 2, 3)]
    verified = [value("dflash_verified_tokens_per_position_total", {"position": str(k)}) for k in (1, 2, 3)]
    assert accepted == [4, 2, 2] and verified == [4, 4, 4]
    rank.add_step([0, 0], block_size=4, seconds=0.01)
    runtime.states = [{"dflash_adaptive": {"steps": rank.to_report()}}] * 2

    async def serve_a_while():  # the poller runs on the serving loop from start() until stop()
        engine.start()
        await asyncio.sleep(0.1)
        engine.stop()
        await asyncio.sleep(0)

    asyncio.run(serve_a_while())
    assert engine._poller.cancelled()
    assert value("dflash_step_seconds_count", cell) == 4  # only what was new
    observation = observation_from_text([metrics.render(0, 0).decode()], now=0.0)
    assert observation.step_seconds[("2-3", 4)] == (pytest.approx(0.06), 4)
    assert observation.verified[1] == 8 and observation.accepted[1] == 4
