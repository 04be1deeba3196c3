"""Structured output stays lossless: with a grammar, greedy speculative
decoding equals a plain constrained loop (the target's logits masked token by
token), its text parses and matches the schema, and sampling under a grammar
follows the constrained target's distribution exactly."""

from __future__ import annotations

import json

import pytest
import torch
from test_sampling import ALPHA, LOOKUP_PROMPT, PROMPT, ROWS, K, V, chi_square_pvalue, exact_joint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from speculative.decode import DecodeConfig, spec_generate
from speculative.grammar import Grammar, GrammarCompiler, grammar_tokenizer
from speculative.sampling import SamplingParams
from speculative.session import DecodeSession

STOPS = (0, 2)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
PAIRS = Grammar("regex", "(a[bc]|b[ac]|c[ab])*")  # each token's successors depend on it: masks differ by path


@pytest.fixture(scope="module")
def compiler(pair):
    target, _, tokenizer = pair
    return GrammarCompiler(lambda: grammar_tokenizer(tokenizer, target.vocab_size, STOPS), target.vocab_size)


@pytest.fixture(scope="module")
def letters():
    """A grammar compiler for the six-token exactness target: tokens a-f, f the end of text."""
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdef")}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return GrammarCompiler(lambda: grammar_tokenizer(fast, V, [V - 1]), V)


@torch.no_grad()
def constrained_greedy(target, prompt, grammar, compiler, n):
    """Plain decoding under ``grammar``: each next token the argmax of the target's masked logits."""
    matcher, out = compiler.matcher(grammar), []
    for _ in range(n):
        logits = target.model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(logits.masked_fill(~matcher.mask(), float("-inf")).argmax()))
        matcher.advance(out[-1:])
        if out[-1] in STOPS:
            break
    return out


def test_greedy_rows_under_a_schema_match_the_constrained_loop_and_parse(pair, compiler):
    target, draft, tokenizer = pair
    grammar = Grammar.json_schema(SCHEMA)
    prompts = [[5 + i, 40, 41, 42, 43][: 3 + i % 3] for i in range(6)]
    params = [SamplingParams(grammar=grammar) if i % 2 == 0 else SamplingParams() for i in range(len(prompts))]
    references = [
        constrained_greedy(target, p, grammar, compiler, 40)
        if s.grammar
        else spec_generate(target, None, [p], DecodeConfig(1, 40, STOPS)).tokens[0]
        for p, s in zip(prompts, params, strict=True)
    ]
    for tokens in references[::2]:
        assert tokens[-1] in STOPS
        reply = json.loads(tokenizer.decode(tokens[:-1]))
        assert set(reply) == {"ok", "tag"} and isinstance(reply["ok"], bool)
        assert reply["tag"] in ("red", "green", "blue")
    tree = DecodeConfig(4, 40, STOPS, branches=3, lookup=4)
    for config in (DecodeConfig(1, 40, STOPS), DecodeConfig(8, 40, STOPS), tree):
        result = spec_generate(target, draft, prompts, config, params, grammars=compiler)
        assert result.tokens == references
    # The schema forces its keys and separators: the constrained rows propose them as their lookup path.
    forced = spec_generate(target, draft, prompts[::2], tree, params[::2], grammars=compiler)
    assert sum(r.lookup_accepted for r in forced.rounds) >= 3 * len(prompts[::2])


def test_a_grammar_needs_a_compiler_and_refuses_min_tokens(pair):
    target, draft, _ = pair
    with pytest.raises(ValueError, match="GrammarCompiler"):
        spec_generate(target, draft, [[5, 6]], DecodeConfig(4, 4), SamplingParams(grammar=PAIRS))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(grammar=PAIRS, min_tokens=2, suppressed=(0,))


def test_invalid_grammars_are_named(compiler):
    assert "unclosed group" in compiler.check(Grammar("regex", "("))
    assert "objectx" in compiler.check(Grammar("json_schema", '{"type": "objectx"}'))
    assert compiler.check(Grammar.json_schema(SCHEMA)) is None


def test_sampling_under_a_grammar_follows_the_constrained_target(small_vocab, letters):
    """Sampled rows under a grammar whose allowed tokens depend on the path, with
    sampled proposals alone and with alternates and lookup paths beside
    unconstrained rows: each kind follows its own target distribution."""
    target, drafts = small_vocab

    def exact(prompt):
        def mask(logits, prefix):
            matcher = letters.matcher(PAIRS)
            matcher.advance(prefix)
            return logits.masked_fill(~matcher.mask(), float("-inf"))

        return exact_joint(target, SamplingParams(1.0), mask, prompt=prompt)

    def counts(tokens):
        codes = torch.tensor([sum(t * V ** (K - 1 - i) for i, t in enumerate(row)) for row in tokens])
        return torch.bincount(codes, minlength=V**K)

    rows = [SamplingParams(1.0, seed=i, grammar=PAIRS) for i in range(ROWS)]
    alone = spec_generate(target, drafts["good"], [PROMPT] * ROWS, DecodeConfig(4, K, proposal="sample"), rows, letters)
    assert chi_square_pvalue(counts(alone.tokens), exact(PROMPT)) > ALPHA
    assert alone.mean_acceptance_length > 1.3  # the chain proposes inside the grammar

    mixed_rows = [SamplingParams(1.0, seed=i, grammar=PAIRS if i % 2 == 0 else None) for i in range(2 * ROWS)]
    config = DecodeConfig(4, K, branches=3, proposal="sample", lookup=4)
    mixed = spec_generate(target, drafts["good"], [LOOKUP_PROMPT] * len(mixed_rows), config, mixed_rows, letters)
    assert chi_square_pvalue(counts(mixed.tokens[::2]), exact(LOOKUP_PROMPT)) > ALPHA
    plain = exact_joint(target, SamplingParams(1.0), prompt=LOOKUP_PROMPT)
    assert chi_square_pvalue(counts(mixed.tokens[1::2]), plain) > ALPHA
    assert sum(r.branches_taken for r in mixed.rounds) > ROWS // 100


def test_a_constrained_row_reports_the_models_own_logprobs(pair, compiler):
    """Log-probabilities of a row under a grammar are the unconstrained target's
    (as OpenAI reports them), not the masked distribution's: the masks must not
    reach the logits they are read from."""
    target, draft, _ = pair
    prompt = [5, 40, 41]
    session = DecodeSession(target, draft, branches=3, lookup=4, grammars=compiler)
    params = SamplingParams(grammar=Grammar.json_schema(SCHEMA), logprobs=2)
    tokens = [session.add(["a"], [prompt], [params])["a"]]
    got = [session.first_logprobs["a"]]
    while tokens[-1] not in STOPS and len(tokens) < 40:
        stats, emitted = session.step(4)
        tokens += emitted["a"]
        got += stats.logprobs["a"]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert [g.token for g in got] == tokens
    for j, g in enumerate(got):
        assert g.logprob == pytest.approx(reference[j, tokens[j]].item(), abs=1e-4)
    assert min(g.logprob for g in got) < -0.5  # the grammar forced tokens the model alone doubted


def test_a_failing_choice_leaves_the_matcher_where_it_was(letters):
    """``chain`` consumes as it chooses; a round that raises part-way (and is then
    retried on halves of the batch) must find each row's grammar state unchanged."""
    matcher = letters.matcher(PAIRS)
    before = matcher.mask()  # a, b, c or the end; after "a" only b or c

    def choose(position, allowed):
        if position == 1:
            raise RuntimeError("the round failed")
        return int(allowed.nonzero()[0])

    with pytest.raises(RuntimeError):
        matcher.chain(choose, 4)
    assert torch.equal(matcher.mask(), before) and before.tolist() == [True, True, True, False, False, True]
