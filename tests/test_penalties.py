"""Repetition penalties stay lossless: greedy speculative decoding with
penalties equals plain decoding with the same penalties (transformers'
``repetition_penalty``, and a direct loop for OpenAI's presence/frequency
penalties), and penalised sampling follows the penalised target exactly."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from builders import random_prompts, reference_greedy
from test_sampling import ALPHA, LOOKUP_PROMPT, PROMPT, ROWS, V, chi_square_pvalue, exact_joint

from speculative.decode import DecodeConfig, spec_generate
from speculative.penalties import TokenHistory, penalize
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree

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


def test_penalize_counts_each_tree_slot_s_own_path():
    """In a tree block (chain 1-2, alternate 3, lookup 4-5) slot s is penalised
    with the tokens on its own path only."""
    g = torch.Generator().manual_seed(4)
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6)]
    prompt, generated = [1, 2], [4]
    history = TokenHistory.from_prompts([prompt], 8, torch.device("cpu"))
    history.add([generated])
    tree = DraftTree.build(3, alternates=1, lookup=2)
    block = torch.tensor([[0, 4, 6, 5, 6, 4]])  # anchor, chain 4 6, alternate 5, lookup 6 4
    logits = torch.randn(1, tree.width, 8, generator=g)
    out = penalize(logits, params, history, block[:, 1:], tree.visibility(torch.device("cpu")))
    on_path = {0: [], 1: [4], 2: [4, 6], 3: [5], 4: [6], 5: [6, 4]}
    for slot, path in on_path.items():
        expected = reference_penalized(logits[0, slot], prompt, generated + path, params[0])
        torch.testing.assert_close(out[0, slot], expected)


@pytest.mark.parametrize("block_size", [4, 16])
def test_repetition_penalty_greedy_matches_transformers(qwen_pair, block_size):
    target, draft = qwen_pair
    params = SamplingParams(repetition_penalty=1.3)
    for prompt in PROMPTS:
        reference = reference_greedy(target, prompt, NEW_TOKENS, repetition_penalty=1.3)
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
    tree = DecodeConfig(4, NEW_TOKENS, branches=4, lookup=4)  # each slot penalised for its own path
    for config in (DecodeConfig(1, NEW_TOKENS), DecodeConfig(8, NEW_TOKENS), tree):
        result = spec_generate(target, draft, PROMPTS, config, params)
        assert result.tokens == references
    # The penalties change the output (else this test could not fail).
    plain = spec_generate(target, None, PROMPTS[:1], DecodeConfig(1, NEW_TOKENS)).tokens[0]
    assert references[0] != plain


def joint_counts(tokens: list[list[int]]) -> torch.Tensor:
    return torch.bincount(torch.tensor([a * V * V + b * V + c for a, b, c in tokens]), minlength=V**3)


def test_penalised_sampling_follows_the_penalised_target(small_vocab):
    target, drafts = small_vocab
    params = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.5)
    rows = [dataclasses.replace(params, seed=i) for i in range(ROWS)]
    result = spec_generate(target, drafts["good"], [PROMPT] * ROWS, DecodeConfig(4, 3, proposal="sample"), rows)
    counts = joint_counts(result.tokens)
    exact = exact_joint(target, params, lambda logits, prefix: reference_penalized(logits, PROMPT, prefix, params))
    assert chi_square_pvalue(counts, exact) > ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, params)) < ALPHA  # the penalties matter here


def test_penalised_rows_with_paths_follow_the_penalised_target(small_vocab):
    """Penalised sampled rows verify lookup paths and alternates beside the
    chain, each slot penalised for its own path, in rounds with unpenalised
    rows: both kinds of row follow their own target distribution, and the
    penalised rows do take paths (a run of them alone)."""
    target, drafts = small_vocab
    penalised = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.5)
    plain = SamplingParams(temperature=1.0)
    rows = [dataclasses.replace((penalised, plain)[i % 2], seed=i) for i in range(2 * ROWS)]
    config = DecodeConfig(4, 3, branches=3, proposal="sample", lookup=4)
    result = spec_generate(target, drafts["good"], [LOOKUP_PROMPT] * len(rows), config, rows)
    adjust = lambda logits, prefix: reference_penalized(logits, LOOKUP_PROMPT, prefix, penalised)  # noqa: E731
    exact = exact_joint(target, penalised, adjust, prompt=LOOKUP_PROMPT)
    assert chi_square_pvalue(joint_counts(result.tokens[::2]), exact) > ALPHA
    exact_plain = exact_joint(target, plain, prompt=LOOKUP_PROMPT)
    assert chi_square_pvalue(joint_counts(result.tokens[1::2]), exact_plain) > ALPHA
    alone = spec_generate(target, drafts["good"], [LOOKUP_PROMPT] * ROWS, config, rows[::2])
    assert chi_square_pvalue(joint_counts(alone.tokens), exact) > ALPHA
    assert sum(r.branches_taken for r in alone.rounds) > ROWS // 100
    assert sum(r.lookup_accepted for r in alone.rounds) > ROWS // 100
