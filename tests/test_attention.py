import pytest
import torch
from builders import random_prompts, target_config, tiny_target
from transformers import LlamaForCausalLM

from speculative.attention import GROUPED_SDPA
from speculative.sampling import SamplingParams
from speculative.session import DecodeSession
from speculative.target import TargetModel
from speculative.tree import DraftTree


def _verify_logits(target: TargetModel, prompts: list[list[int]], tree: DraftTree) -> torch.Tensor:
    """Prefill ``prompts`` as one left-padded batch (``DecodeSession.add``), then verify one tree block per row."""
    session = DecodeSession(target)
    session.add(list(range(len(prompts))), prompts, [SamplingParams()] * len(prompts))
    batch = session.batch
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
