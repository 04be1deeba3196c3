"""The dtype choice: as asked, or measured (``auto``), with the CPU features beside it."""

import pytest
import torch

from speculative.precision import choose_dtype, cpu_features, interleaved_minimum, matmul_ms


def test_an_explicit_dtype_is_kept():
    assert choose_dtype("bfloat16").dtype == torch.bfloat16
    assert choose_dtype("float32").name == "float32"


def test_auto_measures_both_dtypes_and_reports_the_cpu():
    choice = choose_dtype("auto", "cpu")
    assert choice.dtype in (torch.float32, torch.bfloat16)
    assert "bf16" in choice.reason and "fp32" in choice.reason and "CPU features" in choice.reason


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float16"):
        choose_dtype("float16")


def test_cpu_features_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_tile amx_bf16\n")
    assert cpu_features(cpuinfo) == ("avx2", "avx512f", "amx_bf16", "amx_tile")
    assert cpu_features(tmp_path / "absent") == ()


def test_interleaved_minimum_sees_through_a_busy_spell():
    """A second process busy on the cores for the first rounds slows every run
    alike; each run's fastest round is its own cost, so the ratio survives."""
    cost = {"fast": 1.0, "slow": 3.0}
    now = [0.0]
    calls = []

    def run(name):
        def timed():
            calls.append(name)
            busy = 50.0 if len(calls) <= 8 else 0.0  # the other process holds the cores for 4 rounds
            now[0] += cost[name] + busy

        return timed

    best = interleaved_minimum({name: run(name) for name in cost}, rounds=6, clock=lambda: now[0])
    assert best == cost
    assert calls[:4] == ["fast", "slow", "fast", "slow"]  # in turns, not one dtype's rounds after the other's


def test_matmul_timing_restores_the_thread_count():
    threads = torch.get_num_threads()
    times = matmul_ms(torch.device("cpu"), rounds=2)
    assert set(times) == {"float32", "bfloat16"} and all(t > 0 for t in times.values())
    assert torch.get_num_threads() == threads
