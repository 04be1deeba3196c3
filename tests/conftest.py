"""Shared fixtures: tiny targets (Qwen3 and Llama) and DFlash drafts trained on
their own greedy outputs, so acceptance paths of every length get exercised."""

from __future__ import annotations

import pytest
import torch
from builders import (
    EXACT_PROMPT,
    EXACT_VOCAB,
    HIDDEN,
    SMALL_CORPUS,
    draft_config_dict,
    random_prompts,
    tiny_draft,
    tiny_target,
)

from speculative.checkpoint import save_draft
from speculative.config import DFlashConfig
from speculative.decode import DecodeConfig, spec_generate
from speculative.distill import distill_draft
from speculative.draft import DFlashDraftModel
from speculative.sampling import SamplingParams
from speculative.train.corpus import Corpus, function_pairs
from speculative.train.regenerate import RegenerateConfig, regenerate_chat_prompts
from speculative.train.target_lm import TargetTrainConfig, train_target

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


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """A real (tiny) run of every pipeline stage on the stdlib json package."""
    root = tmp_path_factory.mktemp("pipeline")
    target_cfg = TargetTrainConfig(
        out_dir=root / "target",
        run_dir=root / "target-run",
        vocab_size=320,
        hidden_size=HIDDEN,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        context_length=2048,
        seq_len=64,
        batch_size=4,
        steps=40,
        warmup_steps=5,
        checkpoint_every=20,
    )
    target_summary = train_target(target_cfg, Corpus.stdlib(SMALL_CORPUS))
    pairs = [p for t in Corpus.stdlib(SMALL_CORPUS).texts() for p in function_pairs(t)]
    prompts = [*sorted((p.prompt for p in pairs), key=len)[:11], pairs[0].prompt * 20]  # the last: too long
    meta = regenerate_chat_prompts(
        root / "target", prompts, root / "data", RegenerateConfig(max_new_tokens=48, batch_size=5), source="test"
    )
    return root, target_summary, meta


@pytest.fixture(scope="session")
def served_pair_dirs(tiny_pipeline, tmp_path_factory):
    """(target dir, draft dir) on disk for ``dflash-serve`` processes: the tiny
    pipeline target and a random b4 draft in the official format."""
    root, _, _ = tiny_pipeline
    draft_dir = tmp_path_factory.mktemp("served") / "draft"
    raw = draft_config_dict(vocab=320, mask_token_id=3, block_size=4, max_position_embeddings=2048)
    save_draft(DFlashDraftModel(DFlashConfig.from_dict(raw)), draft_dir)
    return root / "target", draft_dir


@pytest.fixture(scope="session")
def model(tiny_pipeline):
    """The tiny pipeline target with its tokenizer and a random b4 draft:
    (root, target, draft, tokenizer) for service tests."""
    from transformers import AutoTokenizer

    from speculative.target import TargetModel

    root, _, _ = tiny_pipeline
    target = TargetModel.from_pretrained(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    raw = draft_config_dict(vocab=320, mask_token_id=3, block_size=4, max_position_embeddings=2048)
    return root, target, DFlashDraftModel(DFlashConfig.from_dict(raw)), tokenizer


@pytest.fixture(scope="session")
def small_vocab():
    """A 6-token target with a distilled ("good") and a confidently wrong ("bad")
    b4 draft, for the exactness tests."""
    V, PROMPT = EXACT_VOCAB, EXACT_PROMPT
    target = tiny_target(vocab=V, lm_head_scale=2.0, seed=21)
    bad = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(vocab=V, mask_token_id=V - 1, block_size=4)))
    with torch.no_grad():
        for name, p in bad.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                p.normal_(0.0, 3 * p.shape[1] ** -0.5)
        bad.norm.weight.mul_(20.0)  # confidently wrong: q is nearly one-hot on arbitrary tokens
    good = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(vocab=V, mask_token_id=V - 1, block_size=4)))
    prompts = random_prompts(256, seed=3, min_len=6, max_len=6, vocab=V) + [PROMPT] * 64
    torch.manual_seed(0)
    data = spec_generate(target, None, prompts, DecodeConfig(block_size=1, max_new_tokens=12), SamplingParams(1.0))
    sequences = torch.tensor([p + o for p, o in zip(prompts, data.tokens, strict=True)])
    distill_draft(good, target, sequences, 6, steps=250)
    return target, {"good": good.eval(), "bad": bad.eval()}


@pytest.fixture(scope="session")
def pair(tiny_pipeline):
    """(target, b8 draft distilled for 60 steps, tokenizer): the tiny pipeline
    target for engine tests."""
    from transformers import AutoTokenizer

    from speculative.target import TargetModel

    root, _, _ = tiny_pipeline
    target = TargetModel.from_pretrained(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    raw = draft_config_dict(vocab=320, mask_token_id=3, block_size=8, max_position_embeddings=2048)
    draft = DFlashDraftModel(DFlashConfig.from_dict(raw))
    prompts = [[5 + i, 40, 41, 42, 43, 44] for i in range(32)]
    result = spec_generate(target, None, prompts, DecodeConfig(block_size=1, max_new_tokens=40))
    sequences = torch.tensor([p + o for p, o in zip(prompts, result.tokens, strict=True)])
    distill_draft(draft, target, sequences, 6, steps=60)
    return target, draft, tokenizer
