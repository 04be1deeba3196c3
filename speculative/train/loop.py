"""What every trainer here shares: warm-up + cosine learning rate, and a
resumable run (step counter, loss curve, elapsed time, checkpoint, progress
bar, time limit)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def warmup_cosine(step: int, total: int, warmup: int, floor: float = 0.0) -> float:
    """Learning-rate factor: linear warm-up over ``warmup`` steps, then cosine
    decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class ResumableRun:
    """Checkpoints ``parts`` (objects with ``state_dict``/``load_state_dict``:
    model, optimizer, scheduler) and the data generator at ``path``, and resumes
    from it when it exists, so a rerun continues bit-identically."""

    def __init__(
        self,
        path: Path,
        parts: dict[str, Any],
        generator: torch.Generator,
        *,
        total_steps: int,
        checkpoint_every: int,
        time_limit_minutes: float,
        name: str,
    ) -> None:
        self.path, self.parts, self.generator = path, parts, generator
        self.total_steps, self.checkpoint_every = total_steps, checkpoint_every
        self.time_limit_s = time_limit_minutes * 60
        self.state: dict[str, Any] = {"step": 0, "curve": [], "seconds": 0.0}
        if path.exists():
            saved = torch.load(path, weights_only=False)
            for key, part in parts.items():
                part.load_state_dict(saved[key])
            generator.set_state(saved["generator"])
            self.state = saved["state"]
        self._started = self._session_started = time.monotonic()
        self.progress = tqdm(total=total_steps, initial=self.step, desc=name, unit="step", mininterval=10)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (over every resumed session)."""
        return int(self.state["step"])

    @property
    def finished(self) -> bool:
        """True once every step is done."""
        return self.step >= self.total_steps

    def elapsed(self) -> float:
        """Training seconds over every resumed session."""
        seconds: float = self.state["seconds"]
        return seconds + time.monotonic() - self._started

    def advance(self, **postfix: str) -> None:
        """Count one step and show ``postfix`` on the progress bar."""
        self.state["step"] += 1
        self.progress.update(1)
        self.progress.set_postfix(postfix)

    def due(self) -> bool:
        """True when this step should be recorded and checkpointed."""
        return self.step % self.checkpoint_every == 0 or self.finished

    def record(self, point: dict[str, Any]) -> None:
        """Append ``point`` (with step and seconds) to the curve, print it, checkpoint."""
        self._bank_time()
        self.state["curve"].append({"step": self.step, **point, "seconds": round(self.state["seconds"], 1)})
        self.progress.write(json.dumps(self.state["curve"][-1]))
        self.save()

    def out_of_time(self) -> bool:
        """Past this session's time limit with steps left: checkpoint and say how
        to resume (the limit is per run of the command, so each rerun gets it anew)."""
        spent = time.monotonic() - self._session_started
        if not self.time_limit_s or self.finished or spent <= self.time_limit_s:
            return False
        self._bank_time()
        self.save()
        self.progress.write(f"time limit reached at step {self.step}: rerun the same command to resume")
        self.progress.close()
        return True

    def save(self) -> None:
        """Write the checkpoint."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {key: part.state_dict() for key, part in self.parts.items()}
        torch.save({**payload, "generator": self.generator.get_state(), "state": self.state}, self.path)

    def close(self) -> None:
        """End the progress bar."""
        self._bank_time()
        self.progress.close()

    def _bank_time(self) -> None:
        self.state["seconds"], self._started = self.elapsed(), time.monotonic()
