"""Which floating dtype to run the models in, chosen by measurement.

bf16 halves the weights' memory traffic, but on a CPU without native bf16
arithmetic (AVX2 only) PyTorch emulates it and a matmul costs several times the
fp32 one; with AVX-512 BF16 or AMX it is faster than fp32. GPUs run bf16
natively. ``auto`` therefore times one decoder-sized matmul in both dtypes on
the device and keeps bf16 only when it is clearly faster, and reports the CPU's
features beside the choice (they decide it, and they belong next to every
benchmark figure).
"""

from __future__ import annotations

import time
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


def matmul_ms(
    dtype: torch.dtype, device: torch.device, *, rows: int = 16, width: int = 576, repeats: int = 20
) -> float:
    """Median time of a [rows, width] x [width, 4*width] matmul (a decoder MLP's shape)."""
    x = torch.randn(rows, width, device=device).to(dtype)
    w = torch.randn(width, 4 * width, device=device).to(dtype)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        x @ w
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[3:])[repeats // 2] * 1e3


def choose_dtype(name: str, device: str | torch.device = "cpu") -> DtypeChoice:
    """``float32`` / ``bfloat16`` as asked, or for ``auto`` the one measured faster here."""
    if name in DTYPES:
        return DtypeChoice(DTYPES[name], "asked for")
    if name != "auto":
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "CUDA runs bf16 natively")
    fp32, bf16 = matmul_ms(torch.float32, device), matmul_ms(torch.bfloat16, device)
    features = " ".join(cpu_features()) or "unknown"
    dtype = torch.bfloat16 if bf16 <= BF16_MARGIN * fp32 else torch.float32
    return DtypeChoice(dtype, f"matmul bf16 {bf16:.3f} ms vs fp32 {fp32:.3f} ms; CPU features: {features}")
