"""The in-place growing cache layer: same contents as concatenation, no copy of
the cache on an append that fits, and assignments (compaction, merging, row
selection) keep working, a compaction in the buffer it came from."""

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


def filled_layer(rows: int, slots: int) -> GrowingLayer:
    layer = GrowingLayer()
    layer.update(torch.randn(rows, 2, slots, 4), torch.randn(rows, 2, slots, 4))
    return layer


def test_a_compaction_is_written_into_the_buffer_it_came_from():
    """Same rows, fewer slots (a compaction's gather): copied into the buffer,
    and the next append still fits it, so nothing is allocated."""
    layer = filled_layer(2, 40)  # capacity 64
    buffer, index = layer._keys.data_ptr(), torch.tensor([0, 3, 4, 9, 30])[None, None, :, None]
    expected = layer.keys.gather(2, index.expand(2, 2, -1, 4))
    layer.keys = layer.keys.gather(2, index.expand(2, 2, -1, 4))
    layer.values = layer.values.gather(2, index.expand(2, 2, -1, 4))
    assert layer._keys.data_ptr() == buffer and torch.equal(layer.keys, expected)
    new = torch.randn(2, 2, 3, 4)
    all_k, _ = layer.update(new, new)
    assert layer._keys.data_ptr() == buffer and torch.equal(all_k, torch.cat([expected, new], dim=2))


def test_a_view_of_the_buffer_is_kept_as_it_is():
    """A prefix of the buffer (a truncation) stays the buffer; a view further
    in cannot be copied over the slots it reads, so it is kept as a tensor."""
    layer = filled_layer(1, 40)
    buffer, slots = layer._keys.data_ptr(), layer.keys.clone()
    layer.keys = layer.keys[:, :, :30]
    assert layer._keys.data_ptr() == buffer and torch.equal(layer.keys, slots[:, :, :30])
    layer.keys = layer.keys[:, :, 10:]
    assert torch.equal(layer.keys, slots[:, :, 10:30])


def test_a_much_smaller_or_reshaped_assignment_lets_the_buffer_go():
    """Far fewer slots than the buffer holds (a long row left and the rest
    were compacted), or other rows (row selection, merging): the tensor itself
    is kept, so the old buffer's memory is freed."""
    layer = filled_layer(2, 400)  # capacity 500
    buffer = layer._keys.data_ptr()
    short = layer.keys[:, :, -20:].clone()
    layer.keys = short
    assert layer._keys.data_ptr() == short.data_ptr() != buffer
    layer = filled_layer(2, 40)
    buffer = layer._keys.data_ptr()
    first = layer.keys[[0]]
    layer.keys = first
    assert layer._keys.data_ptr() == first.data_ptr() != buffer and layer.keys.shape == (1, 2, 40, 4)


def test_a_buffer_made_under_inference_mode_is_only_reused_under_it():
    """The decode step allocates its caches under ``torch.inference_mode``;
    merging and row selection assign outside it, where such a buffer cannot be
    written: the tensor is kept there, and a compaction inside reuses the buffer."""
    with torch.inference_mode():
        layer = filled_layer(2, 40)
    buffer, kept = layer._keys.data_ptr(), layer.keys[:, :, :20].clone()
    layer.keys = kept
    assert layer._keys.data_ptr() == kept.data_ptr() != buffer
    with torch.inference_mode():
        layer = filled_layer(2, 40)
        buffer = layer._keys.data_ptr()
        layer.keys = layer.keys[:, :, 10:].clone()
    assert layer._keys.data_ptr() == buffer


def test_a_full_layer_grows_by_a_quarter():
    """Room for a quarter more than it holds (at least ``MIN_CAPACITY``): the
    spare part stays a small share of what the slot budget counts."""
    layer = filled_layer(1, 400)
    assert layer._keys.shape[2] == layer._values.shape[2] == 500
    layer.update(torch.randn(1, 2, 100, 4), torch.randn(1, 2, 100, 4))
    assert layer._keys.shape[2] == 500  # filled exactly, not grown
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert layer._keys.shape[2] == 627 and layer.get_seq_length() == 501
    assert filled_layer(1, 3)._keys.shape[2] == 64


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
