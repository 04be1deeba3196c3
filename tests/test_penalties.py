"""Repetition penalties stay lossless: greedy speculative decoding with
penalties equals plain decoding with the same penalties (transformers'
``repetition_penalty``, and a direct loop for OpenAI's presence/frequency
penalties), and penalised sampling follows the penalised target exactly."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from builders import random_prompts
from test_sampling import ALPHA, PROMPT, ROWS, V, chi_square_pvalue, exact_joint

from speculative.decode import DecodeConfig, spec_generate
from speculative.penalties import TokenHistory, penalize
from speculative.sampling import SamplingParams

PROMPTS = random_prompts(12, seed=19, min_len=3, max_len=16)
NEW_TOKENS = 32


def reference_penalized(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams):
    """One position's penalised logits, written out token by token."""
    out = logits.clone().float()
    for token in set(prompt) | set(generated):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token, count in Counter(generated).items():
        out[token] -= p.presence_penalty + p.frequency_penalty * count
    return out


@torch.no_grad()
def reference_penalized_greedy(target, prompt: list[int], params: SamplingParams, new_tokens: int) -> list[int]:
    generated: list[int] = []
    for _ in range(new_tokens):
        logits = target.model(torch.tensor([prompt + generated])).logits[0, -1]
        generated.append(int(reference_penalized(logits, prompt, generated, params).argmax()))
    return generated


def test_penalize_matches_the_reference_at_every_block_position():
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6), SamplingParams()]
    prompts, generated = [[1, 2, 2], [3]], [[4, 4, 1], [5]]
    history = TokenHistory.from_prompts([prompts[0], ()], 8, torch.device("cpu"))
    history.add([generated[0], ()])
    logits, drafts = torch.randn(2, 4, 8, generator=g), torch.tensor([[4, 6, 4], [1, 1, 1]])
    out = penalize(logits, params, history, drafts)
    for j in range(4):
        prefix = generated[0] + drafts[0, :j].tolist()
        torch.testing.assert_close(out[0, j], reference_penalized(logits[0, j], prompts[0], prefix, params[0]))
    torch.testing.assert_close(out[1], logits[1])  # no penalty: untouched
    assert penalize(logits, [SamplingParams()] * 2, history) is logits


@pytest.mark.parametrize("block_size", [4, 16])
def test_repetition_penalty_greedy_matches_transformers(qwen_pair, block_size):
    target, draft = qwen_pair
    params = SamplingParams(repetition_penalty=1.3)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        reference = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        result = spec_generate(target, draft, [prompt], DecodeConfig(block_size, NEW_TOKENS), [params])
        assert result.tokens[0] == reference


def test_openai_penalties_greedy_match_plain_decoding_in_ragged_batches(qwen_pair):
    target, draft = qwen_pair
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2),
    ] * 4
    references = [reference_penalized_greedy(target, p, s, NEW_TOKENS) for p, s in zip(PROMPTS, params, strict=True)]
    for block_size in (1, 8):
        result = spec_generate(target, draft, PROMPTS, DecodeConfig(block_size, NEW_TOKENS), params)
        assert result.tokens == references
    # The penalties change the output (else this test could not fail).
    plain = spec_generate(target, None, PROMPTS[:1], DecodeConfig(1, NEW_TOKENS)).tokens[0]
    assert references[0] != plain


def test_penalised_sampling_follows_the_penalised_target(small_vocab):
    target, drafts = small_vocab
    params = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.5)
    rows = [dataclasses.replace(params, seed=i) for i in range(ROWS)]
    result = spec_generate(target, drafts["good"], [PROMPT] * ROWS, DecodeConfig(4, 3, proposal="sample"), rows)
    counts = torch.bincount(torch.tensor([a * V * V + b * V + c for a, b, c in result.tokens]), minlength=V**3)
    exact = exact_joint(target, params, lambda logits, prefix: reference_penalized(logits, PROMPT, prefix, params))
    assert chi_square_pvalue(counts, exact) > ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, params)) < ALPHA  # the penalties matter here
