"""``dflash-sweep`` end to end on the tiny served pair: one real server per
mode, the same load for each, a comparison and a plot."""

from __future__ import annotations

import json

import pytest

from bench.load import LevelResult, RequestResult
from bench.sweep import (
    Mode,
    average_passes,
    block_mix,
    compare,
    default_modes,
    main,
    step_seconds_by_block,
    turns,
)
from service.controller.estimates import Observation


def test_modes_parse_to_server_flags():
    assert Mode.parse("fixed:4", 2.0).flags == (
        "--block-size",
        "4",
        "--controller",
        "false",
        "--profile-startup",
        "true",
    )
    assert Mode.parse("fixed:1", 2.0).flags == ("--block-size", "1", "--controller", "false")
    adaptive = ("--controller", "true", "--controller-interval-s", "1.5", "--profile-startup", "true")
    assert Mode.parse("adaptive", 1.5).flags == adaptive
    with pytest.raises(Exception, match="mode must be"):
        Mode.parse("fixed:x", 2.0)


def test_modes_take_turns_with_a_rotating_first():
    modes = ["fixed:1", "fixed:16", "adaptive"]
    assert [turns(modes, level) for level in range(4)] == [
        modes,
        ["fixed:16", "adaptive", "fixed:1"],
        ["adaptive", "fixed:1", "fixed:16"],
        modes,
    ]


def test_repeated_passes_average_tokens_per_second_and_sum_block_time():
    passes = [
        {"output_tokens_per_s": 10.0, "ttft_p50_s": 1.0, "step_seconds_by_block": {1: 2.0, 4: 1.0}},
        {"output_tokens_per_s": 20.0, "ttft_p50_s": 2.0, "step_seconds_by_block": {1: 3.0}, "achieved_speedup": 0.9},
    ]
    assert average_passes(passes) == {
        "output_tokens_per_s": 15.0,
        "output_tokens_per_s_passes": [10.0, 20.0],
        "ttft_p50_s": 2.0,
        "achieved_speedup": 0.9,  # the passes that have one
        "step_seconds_by_block": {1: 5.0, 4: 1.0},
    }


def test_step_seconds_by_block_sums_buckets_between_scrapes():
    before = Observation(0.0, {("1", 1): (2.0, 10), ("1", 4): (1.0, 3)}, {}, {})
    after = Observation(
        0.0, {("1", 1): (5.0, 20), ("2-3", 1): (1.5, 4), ("1", 4): (1.0, 3), ("2-3", 8): (0.5, 1)}, {}, {}
    )
    seconds = step_seconds_by_block(before, after)
    assert seconds == {1: pytest.approx(4.5), 8: pytest.approx(0.5)}  # b = 4 did not run in between
    assert block_mix(seconds) == "b1 90%, b8 10%"
    assert block_mix({}) == "none"


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_comparison_ratios():
    tps = {"fixed:1": [10, 40], "fixed:16": [20, 10], "adaptive": [19, 38]}
    results = {name: [{"output_tokens_per_s": v} for v in values] for name, values in tps.items()}
    comparison = compare(results, [1, 8])
    assert comparison["adaptive_vs_best_fixed"] == pytest.approx([0.95, 0.95])
    assert comparison["adaptive_vs_fixed16_mean"] == pytest.approx((19 / 20 + 38 / 10) / 2)


def test_sweep_runs_every_mode_and_plots(served_pair_dirs, tmp_path, capsys):
    target, draft = served_pair_dirs
    main(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--modes",
            "fixed:1",
            "fixed:4",
            "adaptive",
            "--concurrency",
            "1",
            "2",
            "--requests-per-level",
            "1",
            "--max-tokens",
            "6",
            "--repeats",
            "2",
            "--plot",
            str(tmp_path / "sweep.png"),
            "--server-logs",
            str(tmp_path / "logs"),
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["levels"]) == {"fixed:1", "fixed:4", "adaptive"}
    assert all(
        len(levels) == 2 and all(level["output_tokens_per_s"] > 0 for level in levels)
        for levels in summary["levels"].values()
    )
    assert len(summary["comparison"]["adaptive_vs_best_fixed"]) == 2
    assert (tmp_path / "sweep.png").stat().st_size > 5_000
    assert "block-size policy" in (tmp_path / "logs" / "adaptive.log").read_text()  # the controller's decisions
    assert (tmp_path / "logs" / "fixed-4.log").stat().st_size > 0
    # Interleaved: every mode runs a level before any mode runs the next one.
    order = summary["order"]
    assert [phase for phase, _, _ in order[::6]] == ["warm-up", "measured 1", "measured 2"]
    assert all(len(level["output_tokens_per_s_passes"]) == 2 for level in summary["levels"]["adaptive"])
    # Each level's engine time is attributed to the block it ran: a fixed server only to its own.
    assert all(set(level["step_seconds_by_block"]) == {"4"} for level in summary["levels"]["fixed:4"])
    assert all(sum(level["step_seconds_by_block"].values()) > 0 for level in summary["levels"]["adaptive"])
    # The achieved speedup from each server's counters: plain decoding's is 1 exactly; the others have a reference.
    assert all(level["achieved_speedup"] == pytest.approx(1.0) for level in summary["levels"]["fixed:1"])
    assert all(level["achieved_speedup"] > 0 for name in ("fixed:4", "adaptive") for level in summary["levels"][name])
    assert len(order) == 3 * 2 * 3
    for start in range(0, len(order), 3):
        assert {mode for _, _, mode in order[start : start + 3]} == {"fixed:1", "fixed:4", "adaptive"}
        assert len({(phase, c) for phase, c, _ in order[start : start + 3]}) == 1
    # The same level's first mode changes from pass to pass.
    firsts = [mode for phase, c, mode in order[::3] if c == 1]
    assert firsts == ["fixed:1", "fixed:4", "adaptive"]


def test_a_levels_acceptance_length_is_over_all_rounds():
    """A request that loops has few long rounds: averaged per request it would
    outweigh the others' many short ones."""
    level = LevelResult(1, 1.0, [RequestResult(0.1, [], 1.0, 96, 12, 84), RequestResult(0.1, [], 1.0, 96, 68, 28)])
    assert level.summary()["acceptance_length"] == pytest.approx((12 + 84 + 68 + 28) / (12 + 68))
    assert LevelResult(1, 1.0, [RequestResult(0.1, [], 1.0, 9)]).summary()["acceptance_length"] is None


def test_default_modes_follow_the_drafts_block_size():
    assert default_modes(4) == ["fixed:1", "fixed:2", "fixed:4", "adaptive"]
    assert default_modes(3) == ["fixed:1", "fixed:2", "fixed:3", "adaptive"]
    assert default_modes(16) == ["fixed:1", "fixed:2", "fixed:4", "fixed:8", "fixed:16", "adaptive"]
