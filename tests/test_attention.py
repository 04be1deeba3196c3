import pytest
import torch
from builders import random_prompts, target_config, tiny_target
from transformers import LlamaForCausalLM

import speculative.attention
from speculative.attention import GROUPED_SDPA
from speculative.masks import RowSpan, row_spans
from speculative.sampling import SamplingParams
from speculative.session import DecodeSession
from speculative.target import TargetModel
from speculative.tree import DraftTree


def _verify_logits(
    target: TargetModel, prompts: list[list[int]], tree: DraftTree, block: torch.Tensor | None = None
) -> torch.Tensor:
    """Prefill ``prompts`` as one left-padded batch (``DecodeSession.add``), then verify one tree block per row
    (``block`` [B, width], random when not given)."""
    session = DecodeSession(target)
    session.add(list(range(len(prompts))), prompts, [SamplingParams()] * len(prompts))
    batch = session.batch
    if block is None:
        shape, seeded = (len(prompts), tree.width), torch.Generator().manual_seed(1)
        block = torch.randint(0, target.vocab_size, shape, generator=seeded)
    positions = batch.lengths[:, None] + tree.depths(block.device)
    with torch.inference_mode():
        return target.forward(
            block, positions, batch.target_cache, batch.slot_positions, block_visible=tree.visibility(block.device)
        ).logits


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_grouped_attention_gives_sdpa_logits_on_tree_blocks(family):
    """A verify block (ragged rows, a tree mask, 4 query heads per K/V head)
    scores exactly as transformers' SDPA scores it with the cache repeated."""
    target = tiny_target(family, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    assert target.grouped_attention and target.model.config._attn_implementation == GROUPED_SDPA
    assert TargetModel(target.model).grouped_attention  # wrapping the model again keeps it grouped
    prompts = random_prompts(3, seed=4, min_len=4, max_len=11)
    tree = DraftTree.build(4, alternates=2, lookup=3)
    grouped = _verify_logits(target, prompts, tree)
    target.model.set_attn_implementation("sdpa")
    torch.testing.assert_close(grouped, _verify_logits(target, prompts, tree), rtol=1e-5, atol=1e-5)


def test_other_attention_implementations_are_left_alone():
    torch.manual_seed(0)
    model = LlamaForCausalLM(target_config("llama", attn_implementation="eager"))
    target = TargetModel(model.eval())
    assert not target.grouped_attention
    assert target.model.config._attn_implementation == "eager"


def test_models_without_grouped_heads_score_as_before():
    """One K/V head per query head: nothing to group, transformers' SDPA runs."""
    target = tiny_target(num_attention_heads=4, num_key_value_heads=4)
    prompts = random_prompts(2, seed=5, min_len=3, max_len=7)
    tree = DraftTree.build(3, alternates=1)
    grouped = _verify_logits(target, prompts, tree)
    target.model.set_attn_implementation("sdpa")
    torch.testing.assert_close(grouped, _verify_logits(target, prompts, tree), rtol=0, atol=0)


def _spans(lengths: list[int], slots: int = 100, call_keys: int = 8):
    """Spans of a batch whose row i holds ``lengths[i]`` committed tokens right-aligned in ``slots`` slots."""
    positions = torch.full((len(lengths), slots), -1)
    for row, n in enumerate(lengths):
        positions[row, slots - n :] = torch.arange(n)
    return row_spans(positions, call_keys)


def test_row_spans_cut_the_padding_where_it_pays():
    # Rows alike: one call over every column.
    assert _spans([40, 38, 40], slots=40) is None
    # A long first row and three short ones: the short ones attend from their own first column.
    assert _spans([100, 10, 12, 9]) == (RowSpan(0, 1, 0), RowSpan(1, 4, 88))
    # The long row in the middle: three runs, the short rows on each side apart.
    assert _spans([10, 100, 12]) == (RowSpan(0, 1, 90), RowSpan(1, 2, 0), RowSpan(2, 3, 88))
    # The saving is below one call's cost: no split.
    assert _spans([100, 95], call_keys=8) is None
    # Every row padded (the longest one left the batch): one span that skips the common padding.
    assert _spans([30, 28]) == (RowSpan(0, 2, 70),)


def test_row_spans_start_at_each_row_s_first_token_and_skip_rows_that_hold_none():
    positions = torch.full((3, 60), -1)
    positions[0] = torch.arange(60)
    positions[1, 50:] = torch.arange(10)
    positions[1, 55] = -1  # a rejected draft inside the row: no cut there
    # Row 2 holds no token: its span reads no cached column at all.
    assert row_spans(positions, call_keys=8) == (RowSpan(0, 1, 0), RowSpan(1, 2, 50), RowSpan(2, 3, 60))
    assert row_spans(positions[:, :0]) is None


@pytest.mark.parametrize("tree", [None, DraftTree.build(4, alternates=2, lookup=3)], ids=["plain", "tree"])
def test_a_long_row_leaves_its_neighbours_reading_only_their_own_columns(monkeypatch, tree):
    """Three short prompts after a 300-token one: the short rows' attention
    reads their own columns only, and every row scores what it scores alone."""
    target = tiny_target("llama", num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    prompts = random_prompts(1, seed=7, min_len=300, max_len=301) + random_prompts(3, seed=6, min_len=5, max_len=12)
    tree = tree or DraftTree.build(1)
    block = torch.randint(0, target.vocab_size, (len(prompts), tree.width), generator=torch.Generator().manual_seed(2))
    reads = []
    inner = speculative.attention._grouped_query_sdpa

    def spy(module, query, key, *args, **kwargs):
        reads.append((query.shape[0], key.shape[2]))
        return inner(module, query, key, *args, **kwargs)

    monkeypatch.setattr(speculative.attention, "_grouped_query_sdpa", spy)
    together = _verify_logits(target, prompts, tree, block)
    layers = target.num_layers
    verify_reads = reads[-2 * layers :]  # the verify forward: two spans a layer
    own = [len(p) + tree.width for p in prompts]
    assert verify_reads[:2] == [(1, own[0]), (3, max(own[1:]))]
    for row, prompt in enumerate(prompts):
        alone = _verify_logits(target, [prompt], tree, block[row : row + 1])
        torch.testing.assert_close(together[row], alone[0], rtol=1e-5, atol=1e-5)
