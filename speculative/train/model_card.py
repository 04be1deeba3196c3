"""Model cards (``README.md``) for the models this project trains, written from
their ``training.json``: what data, what size, how long, what loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open


def parameter_count(model_dir: Path) -> int:
    """Parameters stored in a directory's safetensors files (floating-point
    tensors only: an integer tensor, such as a draft vocabulary map, is no weight)."""
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            slices = [f.get_slice(name) for name in f.keys()]  # noqa: SIM118
            total += sum(math.prod(s.get_shape()) for s in slices if s.get_dtype().startswith(("F", "BF")))
    return total


def write_card(model_dir: Path, title: str, description: str, reproduce: str) -> Path:
    """Write ``model_dir/README.md`` from ``training.json`` and the weights."""
    summary = json.loads((model_dir / "training.json").read_text())
    curve = summary.get("curve", [])
    last = curve[-1] if curve else {}
    device = summary.get("config", {}).get("device", "cpu")  # older summaries trained on CPUs only
    lines = [
        f"# {title}",
        "",
        description,
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {parameter_count(model_dir) / 1e6:.2f} M |",
        f"| optimizer steps | {summary.get('step', '-')} |",
        f"| training time | {summary.get('seconds', 0) / 60:.1f} min (device: {device}) |",
    ]
    lines += [
        f"| final {k.replace('_', ' ')} | {v:.4g} |" for k, v in last.items() if isinstance(v, float) and k != "seconds"
    ]
    for key, value in summary.get("data", {}).items():
        lines.append(f"| data: {key.replace('_', ' ')} | {value} |")
    lines += ["", "Reproduce:", "", "```bash", reproduce, "```", "", "Training curve: `training.json` (`curve`)."]
    card = model_dir / "README.md"
    card.write_text("\n".join(lines) + "\n")
    return card
