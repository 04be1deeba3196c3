import torch
from builders import HIDDEN, random_prompts, tiny_draft, tiny_target
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from speculative.decode import DecodeConfig, spec_generate
from speculative.draft import DFlashDraftModel
from speculative.session import DecodeSession


def reference_context_kv(draft: DFlashDraftModel, features: torch.Tensor, positions: torch.Tensor):
    """Plain per-layer computation, as the official code does it inside each layer."""
    c = draft.hidden_norm(draft.fc(features))
    cos, sin = draft.rotary_emb(c, positions)
    out = []
    for layer in draft.layers:
        attn = layer.self_attn
        shape = (*c.shape[:2], -1, attn.head_dim)
        k = attn.k_norm(attn.k_proj(c).view(shape)).transpose(1, 2)
        v = attn.v_proj(c).view(shape).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        out.append((k, v))
    return out


def test_fused_context_kv_equals_per_layer_reference():
    draft = tiny_draft(layers=3, attention_bias=True, target_layer_ids=[0, 1, 3])
    features = torch.randn(3, 7, 3 * HIDDEN)
    positions = torch.arange(7).expand(3, 7) + torch.tensor([[0], [5], [40]])
    with torch.inference_mode():
        fused = draft.context_kv(features, positions)
    reference = reference_context_kv(draft, features, positions)
    assert len(fused) == 3
    for (k, v), (rk, rv) in zip(fused, reference, strict=True):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-6)


def test_fused_weight_cache_follows_parameter_updates():
    draft = tiny_draft()
    features, positions = torch.randn(1, 4, 2 * HIDDEN), torch.arange(4)[None]
    with torch.inference_mode():
        before = draft.context_kv(features, positions)[0][1].clone()
    with torch.no_grad():
        draft.layers[0].self_attn.v_proj.weight.add_(1.0)
    with torch.inference_mode():
        after = draft.context_kv(features, positions)[0][1]
    torch.testing.assert_close(after, reference_context_kv(draft, features, positions)[0][1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_block_kv_never_stays_in_the_draft_cache(monkeypatch):
    """After every round the draft cache holds exactly the target cache's slots:
    context from target forwards only, never the drafted block."""
    target, draft = tiny_target(), tiny_draft()
    seen = []
    original = DecodeSession._commit

    def spy(self, *args):
        original(self, *args)
        batch = self.batch
        target_len = batch.target_cache.layers[0].keys.shape[2]
        seen.append([layer.keys.shape[2] == target_len == batch.num_slots for layer in batch.draft_cache.layers])

    monkeypatch.setattr(DecodeSession, "_commit", spy)
    spec_generate(target, draft, random_prompts(3, seed=4), DecodeConfig(block_size=8, max_new_tokens=20))
    assert seen and all(all(row) for row in seen)


def _draft_outputs(draft, context_features, anchor_position=10):
    positions = torch.arange(anchor_position)[None]
    context = draft.context_kv(context_features, positions)
    block_positions = anchor_position + torch.arange(4)[None]
    embeddings = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(0))
    return draft(embeddings, block_positions, context, positions)


@torch.inference_mode()
def test_sliding_window_layer_ignores_context_outside_window():
    draft = tiny_draft(layers=1, layer_types=["sliding_attention"], sliding_window=4, is_causal=False)
    features = torch.randn(1, 10, 2 * HIDDEN)
    base = _draft_outputs(draft, features)
    far = features.clone()
    far[:, :5] += 1.0  # positions 0..4: outside the window of every block query (10..13)
    torch.testing.assert_close(_draft_outputs(draft, far), base)
    near = features.clone()
    near[:, 9] += 1.0  # position 9 is inside the window of query 10
    assert not torch.allclose(_draft_outputs(draft, near)[:, 0], base[:, 0])


@torch.inference_mode()
def test_full_attention_block_is_bidirectional_and_causal_flag_is_honoured():
    features = torch.randn(1, 10, 2 * HIDDEN)
    positions = torch.arange(10)[None]
    block_positions = 10 + torch.arange(4)[None]
    embeddings = torch.randn(1, 4, HIDDEN)
    changed = embeddings.clone()
    changed[:, 3] += 1.0
    for causal, first_slot_changes in ((False, True), (True, False)):
        draft = tiny_draft(layers=1, is_causal=causal)
        context = draft.context_kv(features, positions)
        a = draft(embeddings, block_positions, context, positions)
        b = draft(changed, block_positions, context, positions)
        assert (not torch.allclose(a[:, 0], b[:, 0])) is first_slot_changes
