"""DFlash draft checkpoints in the official format: ``config.json`` plus
``model.safetensors`` (or shards listed in ``model.safetensors.index.json``),
tensors named as in the published drafts, no embedding and no LM head. A draft
with a reduced draft vocabulary adds one int64 tensor, ``draft_vocab_ids``, and
``dflash_config.draft_vocab_size`` in its config. A corpus n-gram table for
lookup paths may ship beside the weights (``speculative.ngram_table``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from speculative.config import DFlashConfig
from speculative.draft import VOCAB_IDS_NAME, DFlashDraftModel
from speculative.ngram_table import TABLE_NAME, NgramTable

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors do not match the draft it declares."""


def save_draft(model: DFlashDraftModel, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` into directory ``path``,
    floating-point weights in ``dtype`` (None: as they are; the draft
    vocabulary map stays integer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = dict(model.config.raw)
    raw.setdefault("architectures", ["DFlashDraftModel"])
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    tensors = {
        name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().contiguous().cpu()
        for name, t in model.state_dict().items()
    }
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})


def load_draft(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    packed: bool = False,
) -> DFlashDraftModel:
    """Load a draft from a local directory with strict name and shape checks;
    a draft vocabulary map must match the config's ``draft_vocab_size`` and be
    valid (sorted, distinct, in the vocabulary); an n-gram table beside the
    weights must be for the same vocabulary. ``packed``: for serving,
    its linear weights packed once where the device and dtype allow
    (``DFlashDraftModel.pack_linears``)."""
    path = Path(path)
    config = DFlashConfig.from_file(path)
    tensors = _read_tensors(path)
    try:
        model = DFlashDraftModel(config, draft_vocab_ids=tensors.get(VOCAB_IDS_NAME))
    except ValueError as exc:
        raise CheckpointError(f"draft checkpoint {path}: {exc}") from exc
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{name}: checkpoint {tuple(tensors[name].shape)}, model {tuple(expected[name].shape)}"
        for name in sorted(set(expected) & set(tensors))
        if tensors[name].shape != expected[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if wrong_shape:
        problems.append(f"wrong shapes [{'; '.join(wrong_shape)}]")
    if problems:
        raise CheckpointError(f"draft checkpoint {path} does not match its config: " + "; ".join(problems))
    model.load_state_dict(tensors, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    if (path / TABLE_NAME).exists():
        model.ngram_table = _read_table(path / TABLE_NAME, int(config.architecture.vocab_size))
    if packed:
        model.pack_linears()
    return model


def _read_table(path: Path, vocab_size: int) -> NgramTable:
    try:
        table = NgramTable.load(path)
    except ValueError as exc:
        raise CheckpointError(f"draft n-gram table {path}: {exc}") from exc
    if table.vocab_size != vocab_size:
        raise CheckpointError(f"draft n-gram table {path} is for a vocabulary of {table.vocab_size}, not {vocab_size}")
    return table


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / INDEX_NAME
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / WEIGHTS_NAME).exists():
        weight_map, files = {}, [WEIGHTS_NAME]
    else:
        raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not (path / file).exists():
            raise CheckpointError(f"shard {file} listed in {INDEX_NAME} is missing from {path}")
        with safe_open(str(path / file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if weight_map and weight_map.get(name) != file:
                    raise CheckpointError(f"tensor {name} found in {file} but the index places it elsewhere")
                tensors[name] = shard.get_tensor(name)
    listed_but_absent = sorted(set(weight_map) - set(tensors))
    if listed_but_absent:
        raise CheckpointError(f"tensors {listed_but_absent} listed in {INDEX_NAME} are in no shard")
    return tensors
