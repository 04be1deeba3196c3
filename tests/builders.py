"""Tiny random-weight targets and drafts for tests (built here, never downloaded).

Random models have near-tied logits, so the targets' LM heads are scaled up:
greedy equality then judges the algorithm, not float noise.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from speculative.config import DFlashConfig
from speculative.draft import DFlashDraftModel
from speculative.target import TargetModel

# A small real corpus for pipeline tests: the standard library's json package.
SMALL_CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"
VOCAB = 96
MASK_ID = VOCAB - 1
HIDDEN = 64
# The exactness tests enumerate every continuation: a 6-token vocabulary and one prompt.
EXACT_VOCAB = 6
EXACT_PROMPT = [1, 2, 3, 4, 0, 1]


def target_config(family: str = "qwen3", *, vocab: int = VOCAB, layers: int = 4, **extra):
    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    common.update(extra)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    raise ValueError(family)


def tiny_target(family: str = "qwen3", *, seed: int = 0, lm_head_scale: float = 8.0, **config) -> TargetModel:
    torch.manual_seed(seed)
    cfg = target_config(family, **config)
    model = (Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM)(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_head_scale)
    return TargetModel(model.float().eval())


def draft_config_dict(
    *,
    vocab: int = VOCAB,
    layers: int = 2,
    block_size: int = 16,
    num_target_layers: int = 4,
    target_layer_ids: list[int] | None = (1, 2),
    mask_token_id: int = MASK_ID,
    **extra,
) -> dict:
    """A config in the official format: the target's Qwen3 keys plus DFlash keys."""
    dflash = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "hidden_act": "silu",
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": dflash,
    }
    raw.update(extra)
    return raw


def tiny_draft(*, seed: int = 1, weight_scale: float = 1.0, **config) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(**config)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                p.normal_(0.0, weight_scale * p.shape[1] ** -0.5)
    return model.float().eval()


def random_prompts(
    n: int, *, seed: int, min_len: int = 3, max_len: int = 20, vocab: int = VOCAB - 1
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def reference_greedy(target: TargetModel, prompt: list[int], max_new_tokens: int, **processors: Any) -> list[int]:
    """Target-only greedy decoding by transformers' own ``generate``; ``processors``
    are its logits-processing arguments (``repetition_penalty``, ``sequence_bias``)."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        **processors,
    )
    return out[0, len(prompt) :].tolist()
