import argparse
import json

import pytest
from builders import HIDDEN, VOCAB, draft_config_dict

from speculative.cliflags import add_dataclass_flags, dataclass_kwargs
from speculative.config import (
    DFlashConfig,
    DraftConfigError,
    DraftTargetMismatch,
    LayerAttention,
    build_target_layer_ids,
)
from speculative.train.draft_train import DraftTrainConfig


def test_default_target_layer_ids_match_official_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert build_target_layer_ids(36, 1) == [18]
    with pytest.raises(DraftConfigError):
        build_target_layer_ids(3, 2)


def test_missing_layer_ids_fall_back_to_formula():
    config = DFlashConfig.from_dict(draft_config_dict(target_layer_ids=None, num_target_layers=36, layers=5))
    assert config.target_layer_ids == (1, 9, 17, 25, 33)


def test_block_size_read_from_dflash_config_first_then_top_level():
    top = DFlashConfig.from_dict(draft_config_dict(block_size=10))
    assert top.block_size == 10
    raw = draft_config_dict(block_size=10)
    raw["dflash_config"]["block_size"] = 8
    assert DFlashConfig.from_dict(raw).block_size == 8
    raw.pop("block_size")
    raw["dflash_config"].pop("block_size")
    assert DFlashConfig.from_dict(raw).block_size == 16


def test_official_qwen3_8b_config_parses():
    raw = draft_config_dict(layers=5, num_target_layers=36, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669)
    raw.update(vocab_size=151936, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    config = DFlashConfig.from_dict(json.loads(json.dumps(raw)))
    assert config.mask_token_id == 151669
    assert config.num_layers == 5
    assert config.layer_attention == (LayerAttention(causal=False, window=None),) * 5
    assert config.input_embedding_scale == 1.0


def test_layer_types_causality_and_window():
    raw = draft_config_dict(layer_types=["full_attention", "sliding_attention"], sliding_window=32)
    config = DFlashConfig.from_dict(raw)
    assert config.layer_attention == (LayerAttention(False, None), LayerAttention(True, 32))
    raw["is_causal"] = False
    assert DFlashConfig.from_dict(raw).layer_attention[1] == LayerAttention(False, 32)
    raw = draft_config_dict(dflash_config={"mask_token_id": 5, "causal": True})
    assert DFlashConfig.from_dict(raw).layer_attention[0].causal is True


def test_input_embedding_scale():
    raw = draft_config_dict()
    raw["dflash_config"]["input_embedding_scale"] = 2.5
    assert DFlashConfig.from_dict(raw).input_embedding_scale == 2.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dflash_config": {}}, "mask_token_id"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 4]}}, "outside the target's 4 layers"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": []}}, "non-empty list"),
        ({"block_size": 1}, "block_size"),
        ({"num_target_layers": 0}, "num_target_layers"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
    ],
)
def test_bad_configs_fail_clearly(change, message):
    raw = draft_config_dict()
    raw.update(change)
    with pytest.raises(DraftConfigError, match=message):
        DFlashConfig.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(DraftConfigError, match="no draft config"):
        DFlashConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DraftConfigError, match="not valid JSON"):
        DFlashConfig.from_file(tmp_path)


def test_target_fit_checks():
    config = DFlashConfig.from_dict(draft_config_dict())
    config.check_target(hidden_size=HIDDEN, num_layers=4, embedding_rows=VOCAB, vocab_size=VOCAB)
    cases = [
        (dict(hidden_size=HIDDEN * 2), "hidden size"),
        (dict(num_layers=6), "layer count"),
        (dict(num_layers=2), "out of range"),
        (dict(vocab_size=VOCAB + 1, embedding_rows=VOCAB + 1), "vocabulary"),
        (dict(embedding_rows=VOCAB - 10, vocab_size=VOCAB), "outside the target's embedding table"),
    ]
    for change, message in cases:
        shape = dict(hidden_size=HIDDEN, num_layers=4, embedding_rows=VOCAB, vocab_size=VOCAB)
        shape.update(change)
        with pytest.raises(DraftTargetMismatch, match=message):
            config.check_target(**shape)


def test_dataclass_flags_give_bool_fields_a_yes_and_a_no():
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, DraftTrainConfig, {"target_dir", "data", "out_dir", "run_dir"})
    assert parser.parse_args([]).standardize_features is True
    args = vars(parser.parse_args(["--no-standardize-features", "--lr", "0.01", "--no-packed-linears"]))
    kwargs = dataclass_kwargs(args, DraftTrainConfig, {"target_dir", "data", "out_dir", "run_dir"})
    assert kwargs["standardize_features"] is False and kwargs["packed_linears"] is False and kwargs["lr"] == 0.01
