"""The GPU paths of the training pipeline (run where CUDA is): regeneration
with the generate backend and a time-scheduled draft training run on the
device, written back as a CPU-loadable draft."""

import json
import math

import pytest
import torch

from speculative.checkpoint import load_draft
from speculative.train.draft_train import DraftTrainConfig, train_draft
from speculative.train.regenerate import RegenerateConfig, regenerate_chat_prompts

pytestmark = pytest.mark.gpu

PROMPTS = [f"Explain item {i} of the json module." + " again" * (i % 5) for i in range(24)]


def test_regeneration_and_draft_training_run_on_cuda(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    config = RegenerateConfig(
        max_new_tokens=32, batch_size=8, sampled_share=0.25, backend="generate", device="cuda", dtype="bfloat16"
    )
    meta = regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "data", config, source="gpu")
    assert meta["finished"] and meta["records"] == len(PROMPTS) and meta["response_tokens"] > len(PROMPTS)
    records = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert {r["temperature"] for r in records} == {0.0, 0.7}

    summary = train_draft(
        DraftTrainConfig(
            target_dir=root / "target",
            data=(tmp_path / "data.jsonl", root / "data.jsonl"),
            out_dir=tmp_path / "draft",
            run_dir=tmp_path / "run",
            block_size=8,
            anchor_coverage=2.5,
            batch_size=8,
            epochs=1000.0,
            lr=3e-3,
            checkpoint_every=10,
            holdout=4,
            dtype="bfloat16",
            distill_top_k=8,
            distill_weight=0.5,
            device="cuda",
            schedule_minutes=0.1,
            save_dtype="bfloat16",
        )
    )
    assert summary["finished"] and summary["step"] >= 1  # a schedule of 6 s: how many steps fit is the GPU's business
    assert all(math.isfinite(point["loss"]) for point in summary["curve"] if "loss" in point)
    assert 1.0 <= summary["curve"][-1]["holdout_expected_tau"] <= 8.0
    draft = load_draft(tmp_path / "draft")
    assert draft.fc.weight.device == torch.device("cpu") and draft.block_size == 8
