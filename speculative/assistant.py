"""Assistant checkpoints that borrow the target's embeddings.

An assistant cut from a pretrained target (``dflash-train assistant``) keeps
the target's embeddings frozen, and with a 49k-token vocabulary they are most
of its bytes (SmolLM2's 2-layer assistant: 71 MB with them, 14 MB without).
So it is stored without them: ``model.safetensors`` holds every other tensor
and ``shared_weights.json`` names the tensors to take from the target when it
is loaded. Its ``config.json`` is a plain transformers config, but
``AutoModelForCausalLM.from_pretrained`` alone would start those tensors at
random: load it with :func:`load_assistant`, which also loads ordinary
transformers assistants (no ``shared_weights.json``) unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

WEIGHTS_NAME = "model.safetensors"
SHARED_NAME = "shared_weights.json"


def input_embeddings(model: PreTrainedModel) -> torch.Tensor:
    """The model's input embedding matrix [V, H]."""
    return cast(nn.Embedding, model.get_input_embeddings()).weight  # typed as a plain nn.Module


def shared_with_target(model: PreTrainedModel) -> list[str]:
    """Names of the tensors that are the target's input embeddings: the
    embedding itself and, when the LM head is tied to it, the head."""
    embedding = input_embeddings(model)
    return sorted(name for name, t in model.state_dict().items() if t.data_ptr() == embedding.data_ptr())


def save_assistant(model: PreTrainedModel, path: Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the config, generation config and every tensor except the
    target's embeddings (in ``dtype``) into directory ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    shared = shared_with_target(model)
    tensors = {
        name: t.detach().to(dtype).contiguous().cpu() for name, t in model.state_dict().items() if name not in shared
    }
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    model.config.save_pretrained(str(path))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(path))
    (path / SHARED_NAME).write_text(json.dumps({"from_target_input_embeddings": shared}, indent=2) + "\n")


def load_assistant(path: Path, target: PreTrainedModel, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The assistant in ``path`` in ``dtype``, its shared tensors filled with
    ``target``'s input embeddings; a directory without ``shared_weights.json``
    is an ordinary transformers model and loads as one. Raises ``ValueError``
    when the stored tensors or the target's embeddings do not fit the config."""
    shared_file = path / SHARED_NAME
    if not shared_file.is_file():
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        return model
    shared = set(json.loads(shared_file.read_text())["from_target_input_embeddings"])
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(load_file(str(path / WEIGHTS_NAME)), strict=False)
    if unexpected or set(missing) != shared:
        raise ValueError(
            f"{path}: stored tensors do not fit its config (unexpected {sorted(unexpected)}, "
            f"missing {sorted(set(missing) - shared)}, shared but stored {sorted(shared - set(missing))})"
        )
    if shared != set(shared_with_target(model)):
        raise ValueError(f"{path}: its shared tensors {sorted(shared)} are not tied to its input embeddings")
    embedding, own = input_embeddings(target), input_embeddings(model)
    if embedding.shape != own.shape:
        raise ValueError(f"{path}: the target's embeddings are {tuple(embedding.shape)}, its own {tuple(own.shape)}")
    with torch.no_grad():
        own.copy_(embedding)
    # Parameters stay as from_pretrained leaves them, requiring grad: transformers 5.24's assisted generation
    # ran 2.5-3x slower with an assistant whose parameters do not (docs/LOG.md, 2026-12-03 (6)).
    model.eval()  # type: ignore[no-untyped-call]  # from_config leaves it training; eval is unannotated
    return model
