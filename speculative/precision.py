"""Which floating dtype to run the models in, chosen by measurement.

bf16 halves the weights' memory traffic, but on a CPU without native bf16
arithmetic (AVX2 only) PyTorch emulates it and a matmul costs several times the
fp32 one; with AVX-512 BF16 or AMX it is faster than fp32. GPUs run bf16
natively. ``auto`` therefore times one decoder-sized matmul in both dtypes on
the CPU, in turns and keeping each one's fastest round (a measurement must
survive a second server starting on the same cores: one-shot medians there
read 7 ms for both dtypes and chose fp32 on an AMX machine), keeps bf16 only
when it is clearly faster, and reports the CPU's features beside the choice
(they decide it, and they belong next to every benchmark figure).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The /proc/cpuinfo flags that decide how fast bf16 runs on a CPU."""
BF16_MARGIN = 0.85
"""bf16 is chosen when its matmul takes at most this fraction of fp32's."""


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to use and why (measured times in ms, CPU features)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """``float32`` or ``bfloat16``."""
        return str(self.dtype).removeprefix("torch.")


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The bf16-relevant flags this CPU reports (empty where /proc/cpuinfo is absent)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return tuple(f for f in CPU_FEATURES if f in flags)


def interleaved_minimum(
    runs: Mapping[str, Callable[[], object]], rounds: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Seconds of each of ``runs``, timed once per round in turns, the fastest
    round's. Another process busy on the same cores (a second server starting
    beside this one) only adds time, and in turns it hits every run alike: the
    minimum is each run's own cost."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            start = clock()
            run()
            best[name] = min(best[name], clock() - start)
    return best


def matmul_ms(device: torch.device, *, rows: int = 64, width: int = 576, rounds: int = 30) -> dict[str, float]:
    """Time of a [rows, width] x [width, 4*width] matmul (a decoder MLP's shape,
    as many rows as a verify block or a prefill brings) in each of ``DTYPES``
    (by name), in ms, on one intra-op thread: the per-core speed is what differs
    between the dtypes, and a single thread does not stall on OpenMP barriers
    while another process holds a core. (At 1-16 rows the matmul alone does not
    tell them apart on an AMX CPU, 0.19-0.35 ms in both, though a bf16 decode
    step there costs 0.6x the fp32 one; at 64 rows bf16 takes 0.4x.)"""
    runs = {}
    for name, dtype in DTYPES.items():
        x, w = torch.randn(rows, width, device=device), torch.randn(width, 4 * width, device=device)
        runs[name] = functools.partial(torch.matmul, x.to(dtype), w.to(dtype))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for run in runs.values():  # first calls pick kernels and allocate: not timed
            run()
        seconds = interleaved_minimum(runs, rounds)
    finally:
        torch.set_num_threads(threads)
    return {name: seconds[name] * 1e3 for name in DTYPES}


def choose_dtype(name: str, device: str | torch.device = "cpu") -> DtypeChoice:
    """``float32`` / ``bfloat16`` as asked, or for ``auto`` the one measured faster here."""
    if name in DTYPES:
        return DtypeChoice(DTYPES[name], "asked for")
    if name != "auto":
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "CUDA runs bf16 natively")
    times = matmul_ms(device)
    fp32, bf16 = times["float32"], times["bfloat16"]
    features = " ".join(cpu_features()) or "unknown"
    dtype = torch.bfloat16 if bf16 <= BF16_MARGIN * fp32 else torch.float32
    return DtypeChoice(dtype, f"matmul bf16 {bf16:.3f} ms vs fp32 {fp32:.3f} ms; CPU features: {features}")
