"""OpenAI's ``logit_bias`` stays lossless: greedy speculative decoding with a
bias equals transformers' ``generate`` with the same ``sequence_bias``, in
ragged batches beside unbiased rows and through tree blocks, and biased
sampling follows the biased target's distribution exactly."""

from __future__ import annotations

import pytest
import torch
from builders import random_prompts, reference_greedy
from test_sampling import ALPHA, LOOKUP_PROMPT, PROMPT, ROWS, K, V, chi_square_pvalue, exact_joint

from speculative.decode import DecodeConfig, spec_generate
from speculative.sampling import SamplingParams, bias_logits

PROMPTS = random_prompts(6, seed=23, min_len=3, max_len=14)
NEW_TOKENS = 24


def test_bias_logits_adds_each_rows_bias_at_every_position():
    logits = torch.randn(2, 3, 8)
    params = [SamplingParams(logit_bias=((1, -100.0), (6, 2.5))), SamplingParams()]
    out = bias_logits(logits, params)
    expected = logits.clone()
    expected[0, :, 1] -= 100
    expected[0, :, 6] += 2.5
    torch.testing.assert_close(out, expected)
    assert bias_logits(logits, [SamplingParams()] * 2) is logits


@pytest.mark.parametrize("bad", [((1, 100.5),), ((-1, 1.0),), ((3, 1.0), (3, 2.0))])
def test_a_bias_out_of_range_or_named_twice_is_refused(bad):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def test_biased_greedy_rows_match_transformers_in_ragged_batches(qwen_pair):
    target, draft = qwen_pair
    plain = [reference_greedy(target, prompt, NEW_TOKENS) for prompt in PROMPTS]
    # Ban the token the first row opens with, favour another: the output must change.
    bias = ((plain[0][0], -100.0), (plain[1][3], 4.0))
    params = [SamplingParams(logit_bias=bias) if i % 2 == 0 else SamplingParams() for i in range(len(PROMPTS))]
    references = [
        reference_greedy(target, prompt, NEW_TOKENS, sequence_bias={(t,): b for t, b in p.logit_bias} or None)
        for prompt, p in zip(PROMPTS, params, strict=True)
    ]
    assert references[0] != plain[0] and plain[0][0] not in references[0]
    tree = DecodeConfig(4, NEW_TOKENS, branches=4, lookup=4)
    for config in (DecodeConfig(1, NEW_TOKENS), DecodeConfig(8, NEW_TOKENS), tree):
        assert spec_generate(target, draft, PROMPTS, config, params).tokens == references


def test_biased_sampling_follows_the_biased_target(small_vocab):
    """Sampled rows with a bias, alone and with first-slot alternates and lookup
    paths beside unbiased rows: each kind follows its own target distribution."""
    target, drafts = small_vocab
    bias = ((2, 1.5), (4, -2.0))
    biased, plain = SamplingParams(1.0, logit_bias=bias), SamplingParams(1.0)

    def add_bias(logits, prefix):
        return bias_logits(logits[None, None], [biased])[0, 0]

    def counts(tokens):
        codes = torch.tensor([sum(t * V ** (K - 1 - i) for i, t in enumerate(row)) for row in tokens])
        return torch.bincount(codes, minlength=V**K)

    exact = exact_joint(target, biased, add_bias)
    rows = [SamplingParams(1.0, seed=i, logit_bias=bias) for i in range(ROWS)]
    alone = spec_generate(target, drafts["good"], [PROMPT] * ROWS, DecodeConfig(4, K, proposal="sample"), rows)
    assert chi_square_pvalue(counts(alone.tokens), exact) > ALPHA
    assert chi_square_pvalue(counts(alone.tokens), exact_joint(target, plain)) < ALPHA  # the bias matters here

    mixed_rows = [SamplingParams(1.0, seed=i, logit_bias=bias if i % 2 == 0 else ()) for i in range(2 * ROWS)]
    config = DecodeConfig(4, K, branches=3, proposal="sample", lookup=4)
    mixed = spec_generate(target, drafts["good"], [LOOKUP_PROMPT] * len(mixed_rows), config, mixed_rows)
    assert chi_square_pvalue(counts(mixed.tokens[::2]), exact_joint(target, biased, add_bias, LOOKUP_PROMPT)) > ALPHA
    assert chi_square_pvalue(counts(mixed.tokens[1::2]), exact_joint(target, plain, prompt=LOOKUP_PROMPT)) > ALPHA
    assert sum(r.branches_taken for r in mixed.rounds) > ROWS // 100
    assert sum(r.lookup_accepted for r in mixed.rounds) > ROWS // 100
