"""The dtype choice: as asked, or measured (``auto``), with the CPU features beside it."""

import pytest
import torch

from speculative.precision import choose_dtype, cpu_features


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
