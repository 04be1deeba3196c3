"""Linear weights packed once (oneDNN) compute what ``nn.Linear`` does, keep
tied weights tied and gradients flowing, and decoding with a packed target
stays lossless."""

import copy

import pytest
import torch
import torch.nn.functional as F
from builders import HIDDEN, VOCAB, random_prompts, tiny_target
from torch import nn

from speculative.decode import DecodeConfig, spec_generate
from speculative.packed import PackedLinear, pack_linears, packing_support

pytestmark = pytest.mark.skipif(
    packing_support(torch.device("cpu"), torch.float32) is not None, reason="oneDNN cannot pack fp32 here"
)
PROMPTS = random_prompts(12, seed=7, min_len=3, max_len=20)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (2, 3, 24)])
def test_packed_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    with torch.no_grad():
        assert torch.allclose(packed(x), linear(x), atol=1e-5)
        assert packed(x).shape == (*shape[:-1], 40)


def test_activations_in_another_dtype_are_multiplied_in_the_weights_dtype():
    """Draft training's bf16 held-out pass hands the packed head of a bf16 target
    fp32 activations (autocast leaves oneDNN's op alone); oneDNN refuses mixed
    dtypes. Here the other way round, which every machine that packs can run."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(3, 24).bfloat16()
    with torch.no_grad():
        out = PackedLinear(linear)(x)
        assert out.dtype == torch.float32
        assert torch.allclose(out, linear(x.float()), atol=1e-5)


def test_gradients_flow_through_the_original_weight():
    torch.manual_seed(0)
    linear = nn.Linear(24, 40).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(3, 24, requires_grad=True)
    packed(x).square().sum().backward()
    expected = torch.autograd.grad(F.linear(x, linear.weight, linear.bias).square().sum(), x)[0]
    assert torch.allclose(x.grad, expected)


def test_pack_linears_replaces_every_linear_and_keeps_ties():
    target = tiny_target("llama", tie_word_embeddings=True)
    linears = sum(type(m) is nn.Linear for m in target.model.modules())
    assert pack_linears(target.model) == linears > 0
    assert not any(type(m) is nn.Linear for m in target.model.modules())
    head = target.model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    assert head.weight is target.model.get_input_embeddings().weight


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_target_computes_the_same_logits(family):
    plain, packed = tiny_target(family), tiny_target(family)
    assert packed.pack_linears().endswith("linears packed (oneDNN)")
    ids = torch.tensor([PROMPTS[0]])
    assert torch.allclose(packed.forward_sequences(ids).logits, plain.forward_sequences(ids).logits, atol=1e-4)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_dflash_on_a_packed_target_is_plain_greedy_decoding(qwen_pair, block_size):
    _, draft = qwen_pair
    packed = tiny_target("qwen3")  # the pair's target, rebuilt from its seed
    packed.pack_linears()
    config = DecodeConfig(block_size=1, max_new_tokens=32)
    plain = spec_generate(packed, None, PROMPTS, config).tokens
    result = spec_generate(packed, draft, PROMPTS, DecodeConfig(block_size=block_size, max_new_tokens=32))
    assert result.tokens == plain
    assert result.mean_acceptance_length > 1.2  # drafts really got accepted


def test_a_packed_draft_with_a_reduced_vocabulary_drafts_the_same(qwen_pair):
    target, draft = qwen_pair
    reduced = copy.deepcopy(draft)
    reduced.set_draft_vocab(torch.arange(0, VOCAB, 2))
    packed = copy.deepcopy(reduced)
    assert packed.pack_linears().endswith("linears packed (oneDNN)")
    hidden = torch.randn(2, 3, HIDDEN)
    with torch.no_grad():
        expected = reduced.draft_logits(hidden, target)
        assert torch.allclose(packed.draft_logits(hidden, target), expected, atol=1e-4)
        assert torch.equal(packed.draft_logits(hidden, target).isinf(), expected.isinf())
    plain = spec_generate(target, None, PROMPTS, DecodeConfig(block_size=1, max_new_tokens=32)).tokens
    assert spec_generate(target, packed, PROMPTS, DecodeConfig(block_size=4, max_new_tokens=32)).tokens == plain


def test_packing_is_refused_off_the_cpu():
    assert packing_support(torch.device("meta"), torch.float32) == "packing is for CPUs, the model is on meta"


def test_a_weight_changed_in_place_is_packed_again():
    linear = nn.Linear(24, 40)
    packed = PackedLinear(linear)
    x = torch.randn(3, 24)
    with torch.no_grad():
        linear.weight.mul_(2.0)
        assert torch.allclose(packed(x), linear(x), atol=1e-5)
