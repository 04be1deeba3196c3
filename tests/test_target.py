import pytest
import torch
from builders import random_prompts, tiny_target
from transformers import DynamicCache

from speculative.batch import RaggedBatch


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_captured_layer_l_is_hidden_states_l_plus_1(family):
    """Layer id l means the OUTPUT of decoder layer l = transformers' hidden_states[l + 1]."""
    target = tiny_target(family)
    ids = torch.tensor([random_prompts(1, seed=0, min_len=9, max_len=9)[0]])
    positions = torch.arange(9)[None]
    with torch.no_grad():
        reference = target.model(ids, output_hidden_states=True).hidden_states
        for layer_id in range(target.num_layers - 1):
            out = target.forward(ids, positions, target.new_cache(), positions[:, :0], feature_layers=(layer_id,))
            features = out.features
            torch.testing.assert_close(features, reference[layer_id + 1], rtol=1e-5, atol=1e-5)
            assert not torch.allclose(features, reference[layer_id], atol=1e-3), "off by one"


def test_features_concatenate_in_target_layer_id_order():
    target = tiny_target()
    ids = torch.tensor([[5, 6, 7, 8]])
    positions = torch.arange(4)[None]
    with torch.no_grad():
        reference = target.model(ids, output_hidden_states=True).hidden_states
        features = target.forward(ids, positions, target.new_cache(), positions[:, :0], feature_layers=(2, 0)).features
    torch.testing.assert_close(features, torch.cat([reference[3], reference[1]], dim=-1), rtol=1e-5, atol=1e-5)


def test_capture_rejects_out_of_range_layers():
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="outside"):
        tiny_target().forward(ids, torch.arange(2)[None], DynamicCache(), ids[:, :0], feature_layers=(0, 4))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@torch.no_grad()
def test_ragged_batch_with_holes_matches_single_rows(family):
    """Left padding, masked-out slots and compaction give each row the logits it
    gets alone."""
    target = tiny_target(family)
    prompts = random_prompts(4, seed=8, min_len=3, max_len=12)
    continuation = [[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]]

    def alone(prompt, extra):
        ids = torch.tensor([prompt + extra])
        return target.model(ids).logits[0, -len(extra) :]

    width = max(map(len, prompts))
    ids = torch.zeros(4, width, dtype=torch.long)
    positions = torch.full((4, width), -1)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        positions[i, width - len(p) :] = torch.arange(len(p))
    batch = RaggedBatch(positions[:, :0], target.new_cache(), None)
    target.forward(ids, positions, batch.target_cache, batch.slot_positions)
    batch.commit(positions)
    # A junk block that every row rejects entirely: its slots are masked out.
    junk = batch.lengths[:, None] + torch.arange(3)
    target.forward(torch.full((4, 3), 7), junk, batch.target_cache, batch.slot_positions)
    batch.commit(torch.full_like(junk, -1))
    for compact in (False, True):
        if compact:
            batch.compact()
            assert batch.num_slots == max(map(len, prompts))
        block = batch.lengths[:, None] + torch.arange(3)
        cache_copy = RaggedBatch(batch.slot_positions.clone(), _copy(batch.target_cache), None)
        logits = target.forward(
            torch.tensor(continuation), block, cache_copy.target_cache, cache_copy.slot_positions
        ).logits
        for i in range(4):
            torch.testing.assert_close(logits[i], alone(prompts[i], continuation[i]), rtol=1e-4, atol=1e-4)
    batch.select_rows(torch.tensor([2, 0]))
    block = batch.lengths[:, None] + torch.arange(3)
    logits = target.forward(
        torch.tensor([continuation[2], continuation[0]]), block, batch.target_cache, batch.slot_positions
    ).logits
    torch.testing.assert_close(logits[0], alone(prompts[2], continuation[2]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], alone(prompts[0], continuation[0]), rtol=1e-4, atol=1e-4)


def _copy(cache):
    clone = type(cache)()
    for i, layer in enumerate(cache.layers):
        clone.update(layer.keys.clone(), layer.values.clone(), i)
    return clone
