"""The in-place growing cache layer: same contents as concatenation, no copy of
the cache on an append that fits, and assignments (compaction, merging, row
selection) keep working."""

import pytest
import torch

from speculative.cache import GrowingLayer, growing_cache


def test_appends_match_concatenation_and_reuse_the_buffer():
    layer, keys, values = GrowingLayer(), [], []
    for n in (5, 1, 1, 3, 60, 1):
        k, v = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 4)
        keys.append(k)
        values.append(v)
        before = layer._keys.data_ptr() if layer._keys is not None and layer._keys.dim() == 4 else None
        got_k, got_v = layer.update(k, v)
        assert torch.equal(got_k, torch.cat(keys, dim=2)) and torch.equal(got_v, torch.cat(values, dim=2))
        if n == 1 and before is not None:
            assert layer._keys.data_ptr() == before  # written into spare room, nothing copied
    assert layer.get_seq_length() == 71


def test_assigned_tensors_are_kept_and_grown_on_the_next_append():
    layer = GrowingLayer()
    layer.update(torch.randn(2, 1, 6, 4), torch.randn(2, 1, 6, 4))
    layer.keys = layer.keys[[1]].gather(2, torch.tensor([0, 2, 5])[None, None, :, None].expand(1, 1, 3, 4))
    assert layer.values.shape[2] == 6  # values not assigned yet: still the old ones
    layer.values = layer.values[[1]][:, :, [0, 2, 5]]
    k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    kept_k, kept_v = layer.keys.clone(), layer.values.clone()
    all_k, all_v = layer.update(k, v)
    assert torch.equal(all_k, torch.cat([kept_k, k], dim=2)) and torch.equal(all_v, torch.cat([kept_v, v], dim=2))


def test_keys_and_values_of_different_lengths_are_refused():
    layer = GrowingLayer()
    layer.update(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))
    layer.keys = layer.keys[:, :, :2]
    with pytest.raises(RuntimeError, match="2 keys but 4 values"):
        layer.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))


def test_the_cache_builds_growing_layers():
    cache = growing_cache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 1)
    assert len(cache.layers) == 2 and all(isinstance(layer, GrowingLayer) for layer in cache.layers)


def test_sessions_on_either_cache_decode_and_accept_the_same(qwen_pair):
    """Merging new rows, compaction and row removal over in-place layers: the
    same tokens and the same acceptance as over concatenating ones."""
    from builders import random_prompts

    from speculative.sampling import GREEDY
    from speculative.session import DecodeSession

    target, draft = qwen_pair
    prompts = random_prompts(6, seed=3, min_len=4, max_len=14)
    runs = []
    for in_place in (False, True):
        session = DecodeSession(target, draft, compact_slack=8, in_place_cache=in_place)
        trace = [session.add([0, 1, 2], prompts[:3], [GREEDY] * 3)]
        for step in range(14):
            if step == 3:
                trace.append(session.add([3, 4, 5], prompts[3:], [GREEDY] * 3))
            if step == 8:
                session.remove([1, 4])
            stats, emitted = session.step((4, 8, 1)[step % 3])
            trace.append((stats.committed, emitted))
        runs.append(trace)
    assert runs[0] == runs[1]
    accepted = [n for entry in runs[0] if isinstance(entry, tuple) for n in entry[0]]
    assert max(accepted) > 1  # drafts were accepted, so the draft's context cache was read right
