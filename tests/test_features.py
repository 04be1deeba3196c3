"""The feature store: the target's features of every training record computed
once, resumable by shard, extended when records are appended, refused for
other data, readable by layer subset."""

import json

import pytest
import torch
from builders import random_prompts, tiny_target

from speculative.train.features import INDEX, build_feature_store

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def data():
    target = tiny_target()
    records = [(tokens, len(tokens) // 2) for tokens in random_prompts(7, seed=4, min_len=4, max_len=30)]
    return target, records


def test_stored_features_are_the_targets_own(data, tmp_path):
    target, records = data
    store = build_feature_store(target, records, LAYERS, tmp_path, shard_records=3, batch_tokens=64)
    for i, (tokens, _) in enumerate(records):
        alone = target.forward_sequences(torch.tensor([tokens]), feature_layers=LAYERS).features[0]
        stored = store.features(i)
        assert stored.shape == alone.shape
        torch.testing.assert_close(stored, alone.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
        subset = store.features(i, (3, 0))
        width = target.hidden_size
        assert torch.equal(subset, torch.cat([stored[:, 2 * width :], stored[:, :width]], dim=-1))
    batch = store.batch([1, 4], width=40)
    assert batch.shape == (2, 40, 3 * target.hidden_size) and torch.equal(
        batch[0, : len(records[1][0])], store.features(1)
    )
    with pytest.raises(ValueError, match="not \\[1\\]"):
        store.features(0, (1,))


def test_an_interrupted_build_resumes_at_the_missing_shard(data, tmp_path):
    target, records = data
    build_feature_store(target, records, LAYERS, tmp_path, shard_records=3)
    index = json.loads((tmp_path / INDEX).read_text())
    assert len(index["shards"]) == 3
    last = tmp_path / index["shards"][-1]
    original = last.read_bytes()
    last.unlink()
    index["shards"], index["shard_sha256"] = index["shards"][:-1], index["shard_sha256"][:-1]
    (tmp_path / INDEX).write_text(json.dumps(index))
    build_feature_store(target, records, LAYERS, tmp_path, shard_records=3)
    assert last.read_bytes() == original


def test_a_store_of_other_records_or_layers_is_refused(data, tmp_path):
    target, records = data
    build_feature_store(target, records, LAYERS, tmp_path, shard_records=3)
    with pytest.raises(ValueError, match="other records, layers or target"):
        build_feature_store(target, records, (0, 1), tmp_path, shard_records=3)
    with pytest.raises(ValueError, match="other records, layers or target"):
        build_feature_store(target, records[:-1], LAYERS, tmp_path, shard_records=3)


def test_appended_records_extend_the_store_and_only_theirs_are_computed(data, tmp_path):
    """7 records in shards of 3 leave a partial last shard; 3 records appended
    keep the two full shards' files and compute the rest."""
    target, records = data
    more = [(tokens, len(tokens) // 2) for tokens in random_prompts(3, seed=9, min_len=4, max_len=30)]
    build_feature_store(target, records, LAYERS, tmp_path, shard_records=3)
    first, second = (tmp_path / f"features-0000{i}.safetensors" for i in (0, 1))
    kept = {shard: shard.stat().st_mtime_ns for shard in (first, second)}
    store = build_feature_store(target, records + more, LAYERS, tmp_path, shard_records=3)
    assert {shard: shard.stat().st_mtime_ns for shard in (first, second)} == kept
    assert store.index["records"] == 10 and len(store.index["shards"]) == 4
    fresh = build_feature_store(target, records + more, LAYERS, tmp_path / "fresh", shard_records=3)
    for i in range(10):
        assert torch.equal(store.features(i), fresh.features(i))


def test_a_store_whose_records_changed_is_refused_not_overwritten(data, tmp_path):
    target, records = data
    build_feature_store(target, records, LAYERS, tmp_path, shard_records=3)
    edited = [records[1], records[0], *records[2:]]
    with pytest.raises(ValueError, match="other records, layers or target"):
        build_feature_store(target, edited + records[:2], LAYERS, tmp_path, shard_records=3)


def test_features_only_forward_skips_the_lm_head(data):
    target, records = data
    ids = torch.tensor([records[0][0]])
    full = target.forward_sequences(ids, feature_layers=LAYERS)
    lean = target.forward_sequences(ids, feature_layers=LAYERS, logits=False)
    assert lean.logits.shape[1] == 1 and torch.equal(lean.features, full.features)
    torch.testing.assert_close(lean.logits[:, -1], full.logits[:, -1])


def test_a_teacher_top_k_is_stored_beside_the_features(data, tmp_path):
    """The store's top-k are the target's most likely next tokens at every
    position, with their log-probabilities; padded batches mark padding."""
    target, records = data
    store = build_feature_store(target, records, LAYERS, tmp_path, shard_records=3, batch_tokens=64, teacher_top_k=4)
    assert store.teacher_top_k == 4
    for i, (tokens, _) in enumerate(records):
        logits = target.forward_sequences(torch.tensor([tokens])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1).topk(4, dim=-1)
        ids, logprobs = store.teacher(i)
        assert torch.equal(ids[:, 0], expected.indices[:, 0])  # the argmax is exact; ties below it may swap
        torch.testing.assert_close(logprobs, expected.values.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
    ids, logprobs = store.teacher_batch([0, 2], width=40)
    n = len(records[0][0])
    assert ids.shape == logprobs.shape == (2, 40, 4)
    assert (ids[0, n:] == -1).all() and torch.isinf(logprobs[0, n:]).all()
    plain = build_feature_store(target, records, LAYERS, tmp_path / "plain", shard_records=3)
    with pytest.raises(ValueError, match="no teacher"):
        plain.teacher(0)
    with pytest.raises(ValueError, match="other records, layers or target"):
        build_feature_store(target, records, LAYERS, tmp_path, shard_records=3, teacher_top_k=2)
