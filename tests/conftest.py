"""Shared fixtures: tiny targets (Qwen3 and Llama) and DFlash drafts trained on
their own greedy outputs, so acceptance paths of every length get exercised."""

from __future__ import annotations

import pytest
import torch
from builders import random_prompts, tiny_draft, tiny_target

from speculative.decode import DecodeConfig, spec_generate
from speculative.distill import distill_draft

PROMPT_LEN = 8


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests run only where CUDA is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _trained_pair(family: str):
    target = tiny_target(family)
    prompts = random_prompts(128, seed=5, min_len=PROMPT_LEN, max_len=PROMPT_LEN)
    result = spec_generate(target, None, prompts, DecodeConfig(block_size=1, max_new_tokens=40))
    sequences = torch.tensor([p + o for p, o in zip(prompts, result.tokens, strict=True)])
    draft = tiny_draft()
    distill_draft(draft, target, sequences, PROMPT_LEN, steps=200)
    return target, draft


@pytest.fixture(scope="session")
def qwen_pair():
    return _trained_pair("qwen3")


@pytest.fixture(scope="session")
def llama_pair():
    return _trained_pair("llama")
