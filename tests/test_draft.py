import pytest
import torch
from builders import HIDDEN, VOCAB, draft_config_dict, random_prompts, tiny_draft, tiny_target
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from speculative.config import DFlashConfig, DraftConfigError, DraftTargetMismatch
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


HALF_IDS = torch.arange(1, VOCAB, 2)  # a reduced draft vocabulary: every odd token id


def test_draft_logits_multiply_only_the_vocabulary_rows(monkeypatch):
    """With a map: K-way logits equal the full head's columns of those ids, and
    the serving form puts them back with -inf everywhere else (greedy stays in
    the subset). Without one: exactly the target's LM head."""
    target, draft = tiny_target(), tiny_draft()
    hidden = torch.randn(2, 5, HIDDEN)
    with torch.inference_mode():
        assert torch.equal(draft.draft_logits(hidden, target), target.lm_head(hidden))
        full = target.lm_head(hidden)
        draft.set_draft_vocab(HALF_IDS)
        k_way = draft.draft_logits(hidden, target, full_vocab=False)
        scattered = draft.draft_logits(hidden, target)
    assert k_way.shape == (2, 5, len(HALF_IDS))
    torch.testing.assert_close(k_way, full[..., HALF_IDS])
    assert torch.equal(scattered[..., HALF_IDS], k_way) and torch.isneginf(scattered[..., ::2]).all()
    assert torch.isin(scattered.argmax(-1), HALF_IDS).all()
    assert draft.config.draft_vocab_size == len(HALF_IDS)
    draft.set_draft_vocab(None)
    assert draft.config.draft_vocab_size is None and "draft_vocab_ids" not in draft.state_dict()


def test_draft_head_cache_follows_the_target_head_and_autograd():
    """The sliced head is rebuilt when the LM head changes in place or changes
    dtype, and a slice cached in inference mode never enters autograd."""
    target, draft = tiny_target(), tiny_draft()
    draft.set_draft_vocab(HALF_IDS)
    hidden = torch.randn(1, 3, HIDDEN)
    head = target.model.get_output_embeddings().weight.requires_grad_(False)  # frozen, as in training
    with torch.inference_mode():
        before = draft.draft_logits(hidden, target)
    with torch.no_grad():
        head.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(draft.draft_logits(hidden, target)[..., HALF_IDS], 2 * before[..., HALF_IDS])
    trainable = draft.norm.weight
    loss = draft.draft_logits(draft.norm(hidden), target, full_vocab=False).logsumexp(-1).sum()
    loss.backward()  # fails if the inference-mode slice were reused here
    assert trainable.grad is not None and trainable.grad.abs().sum() > 0
    target.model.double()
    draft.double()
    with torch.inference_mode():
        doubled = draft.draft_logits(hidden.double(), target)
    assert doubled.dtype == torch.float64
    torch.testing.assert_close(doubled[..., HALF_IDS].float(), 2 * before[..., HALF_IDS])


def test_draft_index_and_target_ids_invert_each_other():
    draft = tiny_draft()
    tokens = torch.tensor([[0, 1, 2], [95, 94, 7]])
    assert torch.equal(draft.draft_index(tokens), tokens) and torch.equal(draft.target_ids(tokens), tokens)
    draft.set_draft_vocab(HALF_IDS)
    assert draft.draft_index(tokens).tolist() == [[-1, 0, -1], [47, -1, 3]]
    assert torch.equal(draft.target_ids(torch.arange(len(HALF_IDS))), HALF_IDS)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([3, 1, 5]), "sorted and distinct: id 1 at index 1 follows 3"),
        (torch.tensor([1, 4, 4]), "sorted and distinct: id 4 at index 2 follows 4"),
        (torch.tensor([1, 96]), r"must lie in \[0, 96\)"),
        (torch.tensor([-1, 2]), r"must lie in \[0, 96\)"),
        (torch.tensor([[1, 2]]), "1-D integer"),
        (torch.tensor([1.0, 2.0]), "1-D integer"),
        (torch.tensor([], dtype=torch.long), "non-empty"),
    ],
)
def test_a_bad_draft_vocabulary_is_refused(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_draft().set_draft_vocab(ids)


def vocab_config(size) -> dict:
    return draft_config_dict(dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 2], "draft_vocab_size": size})


def test_draft_vocabulary_must_agree_with_config_and_target():
    config = DFlashConfig.from_dict(vocab_config(3))
    assert config.draft_vocab_size == 3
    with pytest.raises(ValueError, match="declares draft_vocab_size 3 but no draft_vocab_ids"):
        DFlashDraftModel(config)
    with pytest.raises(ValueError, match="has 2 ids but the config's draft_vocab_size says 3"):
        DFlashDraftModel(config, draft_vocab_ids=torch.tensor([1, 2]))
    draft = DFlashDraftModel(config, draft_vocab_ids=torch.tensor([1, 2, 95]))
    for bad in (0, VOCAB + 1, "8"):
        with pytest.raises(DraftConfigError, match="draft_vocab_size must be an integer"):
            DFlashConfig.from_dict(vocab_config(bad))
    shape = dict(hidden_size=HIDDEN, num_layers=4, embedding_rows=VOCAB)
    config.check_target(**shape, vocab_size=VOCAB, draft_vocab_ids=draft.draft_vocab_ids)
    with pytest.raises(DraftTargetMismatch, match="id 95, outside the target's vocabulary of 90 tokens"):
        config.check_target(**shape, vocab_size=90, draft_vocab_ids=draft.draft_vocab_ids)
    with pytest.raises(DraftTargetMismatch, match="the config declares 3 ids, the map has None"):
        config.check_target(**shape, vocab_size=VOCAB)


@torch.inference_mode()
def test_a_long_context_row_leaves_its_neighbours_reading_only_their_own_context(monkeypatch):
    """Draft rows with 500, 6 and 9 context tokens, right-aligned in one padded
    cache: the short rows' attention reads (and copies) their own context only,
    and every row drafts what it drafts alone."""
    draft = tiny_draft(layers=2)
    lengths, slots, width = [500, 6, 9], 500, 4
    features = torch.randn(len(lengths), slots, 2 * HIDDEN, generator=torch.Generator().manual_seed(3))
    positions = torch.full((len(lengths), slots), -1)
    for row, n in enumerate(lengths):
        positions[row, slots - n :] = torch.arange(n)
    context = draft.context_kv(features, positions.clamp(min=0))
    block_positions = torch.tensor(lengths)[:, None] + torch.arange(width)
    embeddings = torch.randn(len(lengths), width, HIDDEN, generator=torch.Generator().manual_seed(4))
    reads = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        reads.append((query.shape[0], key.shape[2]))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    together = draft(embeddings, block_positions, context, positions)
    assert reads[:2] == [(1, 500 + width), (2, 9 + width)]
    for row, n in enumerate(lengths):
        own = [(k[row : row + 1, :, slots - n :], v[row : row + 1, :, slots - n :]) for k, v in context]
        alone = draft(
            embeddings[row : row + 1], block_positions[row : row + 1], own, positions[row : row + 1, slots - n :]
        )
        torch.testing.assert_close(together[row], alone[0], rtol=1e-5, atol=1e-5)
