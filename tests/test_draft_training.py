"""Draft training on real regenerated data at a tiny scale: the mask token is
looked up exactly, anchors follow a coverage, features come from a store built
once, held-out records stay held out as data grows, held-out accuracy is
logged as training goes, and standardised features are folded back into the
written draft."""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import tiny_draft
from transformers import AutoTokenizer

from speculative.checkpoint import load_draft
from speculative.train.draft_train import (
    DraftTrainConfig,
    TargetInputs,
    TrainingClock,
    held_out_records,
    load_records,
    mask_token_id,
    train_draft,
)
from speculative.train.feature_scale import feature_scale, folded, unfold_into
from speculative.train.features import INDEX, FeatureStore
from speculative.train.objective import coverage_counts, sample_anchors


def tiny_config(root: Path, tmp_path: Path, **settings: Any) -> DraftTrainConfig:
    """Training on the tiny pipeline's target and data, writing the draft to
    ``tmp_path/draft`` and the run to ``tmp_path/run``."""
    return DraftTrainConfig(
        target_dir=root / "target",
        data=(root / "data.jsonl",),
        out_dir=tmp_path / "draft",
        run_dir=tmp_path / "run",
        **settings,
    )


def test_the_mask_token_is_looked_up_exactly(tiny_pipeline):
    root, _, _ = tiny_pipeline
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    assert mask_token_id(tokenizer, "<|MASK|>") == tokenizer.get_vocab()["<|MASK|>"] != tokenizer.unk_token_id
    with pytest.raises(ValueError, match=r"'<empty_output>' is not in the target's vocabulary.*--mask-token"):
        mask_token_id(tokenizer, "<empty_output>")


def test_anchor_counts_follow_the_coverage():
    lengths, starts = torch.tensor([100, 10, 400]), torch.tensor([20, 2, 0])
    assert coverage_counts(lengths, starts, 16, 3.0, 64).tolist() == [16, 2, 64]  # 3*80/15, 3*8/15, capped
    anchors, valid = sample_anchors(lengths, starts, torch.tensor([16, 2, 64]), torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 64) and valid.sum(dim=1).tolist() == [16, 2, 64]
    assert anchors[1, :2].tolist() != [0, 0] and (anchors[1, :2] >= 2).all()


def test_training_from_a_feature_store_logs_held_out_accuracy_and_resumes(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    common = dict(
        block_size=8,
        anchors_per_sequence=8,
        anchor_coverage=2.0,
        batch_size=4,
        epochs=6.0,
        lr=3e-3,
        checkpoint_every=4,
        holdout=2,
        feature_store=str(tmp_path / "store"),
        feature_layers="0,1,2,3",
    )
    stopped = train_draft(tiny_config(root, tmp_path, **common, time_limit_minutes=1e-9))
    assert not stopped["finished"]
    store = json.loads((tmp_path / "store" / INDEX).read_text())
    assert store["layer_ids"] == [0, 1, 2, 3] and store["records"] == len(load_records([root / "data.jsonl"], 768))
    summary = train_draft(tiny_config(root, tmp_path, **common))
    assert summary["finished"] and summary["steps"] == math.ceil(6 * (store["records"] - 2) / 4)
    point = summary["curve"][-1]
    assert len(point["holdout_accuracy_per_position"]) == 7 and 1.0 <= point["holdout_expected_tau"] <= 8.0
    assert all(0.0 <= a <= 1.0 for a in point["holdout_accuracy_per_position"])
    assert point["response_tokens_per_second"] > 0
    assert summary["curve"][-1]["loss"] < summary["curve"][0]["loss"]
    assert load_draft(tmp_path / "draft").config.target_layer_ids != (0, 1, 2, 3)  # a subset of the store's layers


def test_training_distils_the_targets_top_k_from_the_store(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    config = tiny_config(
        root,
        tmp_path,
        block_size=8,
        anchor_coverage=2.0,
        batch_size=4,
        epochs=4.0,
        lr=3e-3,
        checkpoint_every=2,
        feature_store=str(tmp_path / "store"),
        distill_top_k=8,
        distill_weight=0.5,
        holdout=2,
        dtype="bfloat16",  # the target in bf16 too, and the held-out pass under the same autocast
    )
    summary = train_draft(config)
    assert summary["finished"] and summary["curve"][-1]["loss"] < summary["curve"][0]["loss"]
    assert json.loads((tmp_path / "store" / INDEX).read_text())["teacher_top_k"] == 8
    with pytest.raises(ValueError, match="needs distill_top_k"):
        dataclasses.replace(config, distill_top_k=0)


def test_a_holdout_of_every_record_is_refused(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    every = len(load_records([root / "data.jsonl"], 768))
    config = tiny_config(root, tmp_path, holdout=every)
    with pytest.raises(ValueError, match="leaves none"):
        train_draft(config)


def test_appended_records_never_move_a_trained_record_into_the_holdout():
    """Continuing on grown data must not judge the draft on what it trained on:
    the held-out set of the grown data is old held-out records and new ones."""
    records = [([i, i + 1, i + 2], 1) for i in range(60)]
    appended = [([i, 7, i], 1) for i in range(100, 160)]
    before = held_out_records(records, 8, seed=0)
    after = held_out_records(records + appended, 8, seed=0)
    assert len(before) == len(after) == 8
    assert set(after) <= set(before) | set(range(60, 120))
    assert set(after) - set(before)  # new records did take places: the test covers the displacement
    assert held_out_records(records, 8, seed=1) != before


def test_standardised_features_fold_into_the_saved_fc():
    torch.manual_seed(0)
    draft = tiny_draft()
    raw = torch.randn(2, 9, draft.fc.in_features)
    raw[..., 5] *= 500.0  # an outlier channel, as pretrained targets have
    raw[:, 0] *= 100.0  # and an attention-sink position
    scale = feature_scale(lambda i, t: TargetInputs(raw[i[0] : i[0] + 1]), [([0] * 9, 0)] * 2, [0, 1], 0)
    assert 400 < scale[5] < 600 and scale[:5].max() < 2  # position 0 is left out of the scale
    saved = folded(draft, scale)
    with torch.no_grad():
        assert torch.allclose(saved.context_features(raw), draft.context_features(raw / scale), atol=1e-4)
        unfold_into(saved, scale)
        assert torch.allclose(saved.fc.weight, draft.fc.weight, rtol=1e-5)


def test_a_trained_draft_is_written_for_raw_features(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    cfg = tiny_config(
        root,
        tmp_path,
        block_size=4,
        batch_size=4,
        epochs=1.0,
        lr=3e-3,
        feature_store=str(tmp_path / "store"),
        scale_records=4,
    )
    train_draft(cfg)
    trained = load_draft(tmp_path / "draft")  # then its training weights: fc on standardised features
    trained.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["draft"])
    records = load_records(cfg.data, cfg.max_length)
    store = FeatureStore(tmp_path / "store")
    scale = feature_scale(lambda i, t: TargetInputs(store.batch(i, t.shape[1])), records, range(4), 0)
    raw = store.batch([0], len(records[0][0]), trained.config.target_layer_ids)
    with torch.no_grad():
        expected = trained.context_features(raw.float() / scale)
        assert torch.allclose(load_draft(tmp_path / "draft").context_features(raw.float()), expected, atol=1e-4)


def test_a_time_schedule_decays_the_learning_rate_over_time_and_ends_the_run(tiny_pipeline, tmp_path):
    clock = TrainingClock(steps=10_000, warmup_ratio=0.1, schedule_s=100.0)
    clock.seconds = 5.0
    warming = clock.factor(1)
    clock.seconds = 10.0
    top = clock.factor(2)
    clock.seconds = 55.0
    middle = clock.factor(3)
    clock.seconds = 99.9
    assert 0.4 < warming < 0.6 and top == pytest.approx(1.0) and 0.4 < middle < 0.6 and clock.factor(4) < 0.01
    assert not clock.over(99.9) and clock.over(100.0)
    assert TrainingClock(steps=100, warmup_ratio=0.1, schedule_s=0.0).factor(55) == pytest.approx(0.5, abs=0.02)

    root, _, _ = tiny_pipeline
    summary = train_draft(tiny_config(root, tmp_path, block_size=4, epochs=1000.0, schedule_minutes=0.05))
    assert summary["finished"] and summary["step"] < summary["steps"]  # time, not the step count, ended it
    assert summary["seconds"] >= 3.0 and load_draft(tmp_path / "draft").block_size == 4
