"""Speculative sampling is exact: outputs follow the target's own distribution.

Each distribution check is a chi-square goodness-of-fit test against the exact
target distribution (computed by enumeration), with cells of expected count < 5
pooled. Its false-alarm rate is ALPHA = 0.1 % per check for a correct
implementation; every run is seeded, so the outcome is deterministic.
"""

import copy
import dataclasses
import itertools

import pytest
import torch
from builders import EXACT_PROMPT, EXACT_VOCAB, random_prompts, reference_greedy
from scipy.stats import chisquare

from speculative import session
from speculative.decode import DecodeConfig, GenerationResult, spec_generate
from speculative.ngram_table import NgramTable
from speculative.penalties import TokenHistory, penalize
from speculative.sampling import SamplingParams, inverse_cdf, probabilities, sample_rows
from speculative.tree import DraftTree
from speculative.verify import Verdict, verify_greedy_tree, verify_sampled, verify_sampled_tree

ALPHA = 1e-3
V, PROMPT = EXACT_VOCAB, EXACT_PROMPT
K = 3  # generated tokens whose joint distribution is checked (V**K cells)
REDUCED_IDS = torch.tensor([0, 2, 3, 5])  # a reduced draft vocabulary: 4 of the V = 6 tokens
ROWS = 6000
# Ends with 1 after "1 t" for every token t: a row's first round always finds a 2-gram lookup.
LOOKUP_PROMPT = [1, 0, 3, 1, 1, 4, 1, 2, 5, 1, 3, 2, 1, 4, 0, 1, 5, 5, 1]
WARPS = {
    "t1": dict(temperature=1.0),
    "t0.8-k4-p0.9": dict(temperature=0.8, top_k=4, top_p=0.9),
    "t1-minp0.6": dict(temperature=1.0, min_p=0.6),  # drops 112 of the 216 three-token sequences
}


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.double(), probs.double()
    assert counts[probs == 0].sum() == 0, "a token sequence of probability zero was produced"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(chisquare(counts, expected).pvalue)


# ---------------------------------------------------------------- unit level


@pytest.mark.parametrize("proposal", ["good", "bad", "argmax"])
def test_first_token_of_a_verified_block_follows_p(proposal):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, 3, 8, generator=g) * 2, dim=-1)
    q = {
        "good": torch.softmax(p.log()[:, :2] + 0.3 * torch.randn(1, 2, 8, generator=g), -1),
        "bad": torch.softmax(-3 * p.log()[:, :2], -1),
    }.get(proposal)
    n = 40000
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    if q is None:
        drafts = torch.randint(0, 8, (n, 2), generator=g)
        draft_probs = None
    else:
        drafts = torch.multinomial(q[0].repeat(n, 1), 1, generator=g).view(n, 2)
        draft_probs = q.expand(n, -1, -1)
    verdict = verify_sampled(drafts, draft_probs, p.expand(n, -1, -1), generators)
    first = torch.where(verdict.num_accepted > 0, drafts[:, 0], verdict.next_token)
    assert chi_square_pvalue(torch.bincount(first, minlength=8), p[0, 0]) > ALPHA


@pytest.mark.parametrize("proposal", ["good", "bad"])
def test_first_token_with_alternates_follows_p(proposal):
    """A sampled draft x and, as in a round, the draft's runner-ups to x as
    first-slot alternates (so they depend on x), beside a lookup token: the
    first committed token still follows p, and alternates do get taken."""
    g, vocab, n = torch.Generator().manual_seed(5), 8, 40000
    p = torch.softmax(torch.randn(vocab, generator=g) * 2, dim=-1)
    logits_q = {"good": p.log() + 0.5 * torch.randn(vocab, generator=g), "bad": -3 * p.log()}[proposal]
    q = torch.softmax(logits_q, -1)
    tree = DraftTree.build(2, alternates=3, lookup=1)
    x = torch.multinomial(q.repeat(n, 1), 1, replacement=True, generator=g)[:, 0]
    alternates = logits_q.repeat(n, 1).scatter(1, x[:, None], float("-inf")).topk(3, dim=1).indices
    lookup = torch.full((n, 1), int(p.argsort()[-2]))  # a fixed guess: the target's second choice
    block = torch.cat([torch.zeros(n, 1, dtype=torch.long), x[:, None], alternates, lookup], dim=1)
    target_probs = torch.softmax(torch.randn(n, tree.width, vocab, generator=g), -1)
    target_probs[:, 0] = p
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    verdict = verify_sampled_tree(block, None, tree, q.expand(n, 1, -1), target_probs, generators)
    rows = torch.arange(n)
    first = torch.where(verdict.num_accepted > 0, block[rows, verdict.path_end], verdict.next_token)
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab), p) > ALPHA
    if proposal == "good":  # the bad draft's runner-ups are the target's least likely tokens
        assert tree.is_alternate(verdict.path_end).sum() > n // 20
    assert torch.equal(verdict.draft_accepted, ((verdict.path_end > 0) & (verdict.path_end < tree.lookup_start)).long())


def test_greedy_rows_through_the_sampler_equal_greedy_verification():
    logits = torch.randn(5, 4, 16)
    drafts = logits.argmax(-1)[:, :3].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % 16
    drafts[2, 2] = (drafts[2, 2] + 1) % 16
    greedy = probabilities(logits, [SamplingParams()] * 5)
    generators = [torch.Generator().manual_seed(i) for i in range(5)]
    for draft_probs in (None, probabilities(torch.randn(5, 3, 16), [SamplingParams()] * 5)):
        verdict = verify_sampled(drafts, draft_probs, greedy, generators)
        assert verdict.num_accepted.tolist() == [3, 0, 2, 3, 3]
        assert verdict.next_token.tolist() == logits.argmax(-1).gather(1, verdict.num_accepted[:, None])[:, 0].tolist()


def test_top_k_top_p_warping():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    top_p = probabilities(logits, [SamplingParams(temperature=1.0, top_p=0.75)])
    torch.testing.assert_close(top_p[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    top_k = probabilities(logits, [SamplingParams(temperature=1.0, top_k=3)])
    torch.testing.assert_close(top_k[0, 0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    hot = probabilities(logits, [SamplingParams(temperature=2.0)])
    torch.testing.assert_close(hot[0, 0], torch.softmax(logits[0, 0] / 2, -1))
    assert probabilities(logits, [SamplingParams()])[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    """After the temperature, a token survives ``min_p`` when its probability is
    at least ``min_p`` times the most likely token's, written out per token; then
    top-k and top-p apply to what is left, renormalised."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 12, generator=g) * 2
    params = [SamplingParams(1.3, min_p=0.3), SamplingParams(1.0, min_p=0.0), SamplingParams(0.7, min_p=0.1, top_k=3)]
    probs = probabilities(logits, params)
    for row, p in enumerate(params):
        for pos in range(2):
            warm = torch.softmax(logits[row, pos] / p.temperature, -1)
            kept = warm >= p.min_p * warm.max()
            if p.top_k:
                kept &= torch.zeros_like(kept).scatter(0, warm.masked_fill(~kept, 0).topk(p.top_k).indices, True)
            expected = torch.where(kept, warm, 0) / warm[kept].sum()
            torch.testing.assert_close(probs[row, pos], expected)
    assert (probs[0] == 0).any()  # min_p 0.3 drops tokens here


def test_warping_and_penalties_keep_tokens_outside_a_draft_vocabulary_at_zero():
    """Draft logits are -inf outside a reduced draft vocabulary: every warping
    (greedy, temperature, top-k, top-p) and every penalty leaves those tokens
    at probability zero, never NaN, and greedy never picks one."""
    logits = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1)) * 3
    outside = torch.tensor([0, 3, 4, 7])
    logits[..., outside] = float("-inf")
    params = [
        SamplingParams(),
        SamplingParams(1.0),
        SamplingParams(0.7, top_k=6),
        SamplingParams(1.0, top_p=0.5),
        SamplingParams(1.3, top_k=3, top_p=0.9, repetition_penalty=1.5, frequency_penalty=-2.0, presence_penalty=2.0),
    ]
    history = TokenHistory.from_prompts([[0, 1, 3], [7]] * 2 + [[3, 4, 5]], 8, logits.device)
    history.add([[3, 3, 0]] * 5)
    penalized = penalize(logits, params, history)
    assert torch.isneginf(penalized[..., outside]).all() and not penalized.isnan().any()
    probs = probabilities(penalized, params)
    assert not probs.isnan().any() and (probs[..., outside] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, 3))
    assert not torch.isin(penalized.argmax(-1), outside).any()


@pytest.mark.parametrize("alternates", [0, 3])
@pytest.mark.parametrize("sampled_q", [False, True])
def test_greedy_rows_through_the_sampled_tree_equal_the_greedy_tree(sampled_q, alternates):
    """One-hot target rows make recursive rejection sampling over the chain,
    first-slot alternates and a lookup path commit what greedy tree
    verification commits: the same tokens and following token; without
    alternates the same path and split between the draft's tokens and lookup's
    (an alternate holding a lookup token that goes no deeper ties with it:
    greedy takes the alternate's slot, sampling the lookup's, the same token)."""
    rows, vocab, gen = 400, 12, torch.Generator().manual_seed(4)
    tree = DraftTree.build(4, alternates=alternates, lookup=5)
    choices: dict[tuple[int, ...], int] = {}  # the target's argmax after each token sequence

    def target_choice(path: tuple[int, ...]) -> int:
        return choices.setdefault(path, int(torch.randint(vocab, (), generator=gen)))

    block = torch.zeros(rows, tree.width, dtype=torch.long)
    argmax = torch.zeros_like(block)
    for row in range(rows):
        paths: list[tuple[int, ...]] = []
        for slot, parent in enumerate(tree.parents):
            if parent < 0:
                paths.append((0,))
            else:
                # A slot holds the target's choice after its parent 70 % of the time, so paths run
                # deep, and lookup and chain often agree (then both paths stay alive together).
                hit = float(torch.rand((), generator=gen)) < 0.7
                token = target_choice(paths[parent]) if hit else int(torch.randint(vocab, (), generator=gen))
                paths.append((*paths[parent], token))
            block[row, slot], argmax[row, slot] = paths[slot][-1], target_choice(paths[slot])
    valid = torch.ones(rows, tree.width, dtype=torch.bool)
    valid[:, tree.lookup_start + 2 :] = torch.rand(rows, 1, generator=gen) < 0.5  # short lookups too
    logits = torch.nn.functional.one_hot(argmax, vocab).float()
    draft_probs = torch.softmax(torch.randn(rows, 3, vocab, generator=gen), -1) if sampled_q else None
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    sampled = verify_sampled_tree(block, valid, tree, draft_probs, logits, generators)
    greedy = verify_greedy_tree(block, valid, tree, logits)
    same = (
        ("num_accepted", "next_token")
        if alternates
        else ("num_accepted", "next_token", "path_end", "kept", "draft_accepted")
    )
    for field in same:
        assert torch.equal(getattr(sampled, field), getattr(greedy, field)), field
    for row in range(rows):
        assert block[row][sampled.kept[row]].tolist() == block[row][greedy.kept[row]].tolist()
    assert greedy.num_accepted.float().mean() > 1.5 and (greedy.path_end >= tree.lookup_start).sum() > rows // 10
    if alternates:
        assert tree.is_alternate(sampled.path_end).sum() > rows // 20


# ---------------------------------------------------------------- end to end


def exact_joint(target, params: SamplingParams, transform=None, prompt=PROMPT) -> torch.Tensor:
    """P(first K generated tokens) of target-only sampling, by enumeration;
    ``transform(logits, generated)`` adjusts each prefix's logits first."""
    joint = torch.ones(1)
    for depth in range(K):
        prefixes = list(itertools.product(range(V), repeat=depth))
        ids = torch.tensor([prompt + list(prefix) for prefix in prefixes])
        with torch.no_grad():
            logits = target.model(ids).logits[:, -1:]
        if transform is not None:
            rows = [transform(row[0], list(prefix)) for row, prefix in zip(logits, prefixes, strict=True)]
            logits = torch.stack(rows)[:, None]
        step = probabilities(logits, [params] * len(prefixes))[:, 0]
        joint = (joint[:, None] * step).flatten()
    return joint


def spec_joint(
    target, draft, params: SamplingParams, proposal: str, prompt=PROMPT, lookup: int = 0, branches: int = 1
) -> tuple[torch.Tensor, GenerationResult]:
    """Counts of the first K generated tokens of ROWS seeded rows [V**K], and the run."""
    rows = [dataclasses.replace(params, seed=i) for i in range(ROWS)]
    config = DecodeConfig(block_size=4, max_new_tokens=K, proposal=proposal, lookup=lookup, branches=branches)
    result = spec_generate(target, draft, [prompt] * ROWS, config, rows)
    codes = torch.tensor([sum(t * V ** (K - 1 - i) for i, t in enumerate(tokens)) for tokens in result.tokens])
    return torch.bincount(codes, minlength=V**K), result


def spec_joint_counts(target, draft, params: SamplingParams, proposal: str) -> tuple[torch.Tensor, float]:
    counts, result = spec_joint(target, draft, params, proposal)
    return counts, result.mean_acceptance_length


@pytest.mark.parametrize("warp", sorted(WARPS))
@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_speculative_sampling_matches_target_distribution(small_vocab, warp, proposal):
    target, drafts = small_vocab
    params = SamplingParams(**WARPS[warp])
    exact = exact_joint(target, params)
    taus = {}
    for name, draft in drafts.items():
        counts, taus[name] = spec_joint_counts(target, draft, params, proposal)
        assert chi_square_pvalue(counts, exact) > ALPHA, f"{name} draft, tau {taus[name]:.2f}"
    if proposal == "sample":
        # The good draft is good: most of its sampled proposals survive. (Argmax
        # proposals of this high-entropy target pass only when a sample hits the mode.)
        assert taus["good"] > taus["bad"] + 0.5, taus


@pytest.fixture(scope="module")
def reduced_draft(small_vocab):
    """The good draft proposing only from ``REDUCED_IDS``."""
    target, drafts = small_vocab
    draft = copy.deepcopy(drafts["good"])
    draft.set_draft_vocab(REDUCED_IDS)
    return target, draft


@pytest.mark.parametrize("warp", sorted(WARPS))
def test_reduced_draft_vocabulary_keeps_sampling_exact(reduced_draft, warp, monkeypatch):
    """Sampled proposals from 4 of the 6 tokens (q is zero at the other two,
    which carry much of the target's mass): the output still follows the
    target's distribution, and drafts do get accepted."""
    target, draft = reduced_draft
    params = SamplingParams(**WARPS[warp])
    exact = exact_joint(target, params)
    excluded = ~torch.isin(torch.arange(V), REDUCED_IDS)
    assert exact.view(V, -1).sum(1)[excluded].sum() > 0.2  # the first token is often one the draft cannot propose
    proposals = []
    original = session.DecodeSession._propose

    def spy(self, *args):
        drafts, q, alternates = original(self, *args)
        proposals.append((drafts.flatten(), q))
        return drafts, q, alternates

    monkeypatch.setattr(session.DecodeSession, "_propose", spy)
    counts, tau = spec_joint_counts(target, draft, params, "sample")
    assert chi_square_pvalue(counts, exact) > ALPHA, f"tau {tau:.2f}"
    assert all(torch.isin(d, REDUCED_IDS).all() and (q[..., excluded] == 0).all() for d, q in proposals)
    assert tau > 1.8  # measured: 2.45 (t1), 2.36 (top-k/top-p)


def test_the_check_detects_a_reduced_vocabulary_q_left_unnormalised(reduced_draft, monkeypatch):
    """Power check: reporting q as if the draft's mass outside its vocabulary
    were still there (halving q on the subset) must fail the same test."""
    target, draft = reduced_draft

    def half_q(drafts, draft_probs, target_probs, generators):
        return verify_sampled(drafts, draft_probs * 0.5, target_probs, generators)

    monkeypatch.setattr(session, "verify_sampled", half_q)
    params = SamplingParams(temperature=1.0)
    counts, _ = spec_joint_counts(target, draft, params, "sample")
    assert chi_square_pvalue(counts, exact_joint(target, params)) < ALPHA


def test_the_check_detects_a_wrong_verifier(small_vocab, monkeypatch):
    """Power check: accepting every draft (no rejection) must fail the same test."""
    target, drafts = small_vocab

    def accept_all(drafts_, draft_probs, target_probs, generators):
        n = drafts_.shape[1]
        return Verdict(torch.full((len(drafts_),), n), target_probs[:, -1].argmax(-1))

    monkeypatch.setattr(session, "verify_sampled", accept_all)
    params = SamplingParams(temperature=1.0)
    counts, _ = spec_joint_counts(target, drafts["bad"], params, "sample")
    assert chi_square_pvalue(counts, exact_joint(target, params)) < ALPHA


@pytest.mark.parametrize("warp", sorted(WARPS))
@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_lookup_paths_keep_sampling_exact(small_vocab, warp, proposal):
    """Sampled rows verify an n-gram lookup path beside the chain (every row's
    first round has one here): the output still follows the target's
    distribution, and lookup tokens do get committed."""
    target, drafts = small_vocab
    params = SamplingParams(**WARPS[warp])
    counts, result = spec_joint(target, drafts["good"], params, proposal, prompt=LOOKUP_PROMPT, lookup=4)
    assert chi_square_pvalue(counts, exact_joint(target, params, prompt=LOOKUP_PROMPT)) > ALPHA
    lookup_tokens = sum(r.lookup_accepted for r in result.rounds)
    assert lookup_tokens > ROWS // 100


def test_sampled_rows_do_not_continue_from_the_draft_table(small_vocab):
    """The draft's corpus table proposes for greedy rows only (a sampled answer
    strays from the corpus's phrasing): sampled rows decode exactly as without a
    table, draw for draw, while a greedy row beside them does use it."""
    target, drafts = small_vocab
    samples = [SamplingParams(1.0, seed=i) for i in range(64)]
    answers = spec_generate(target, None, [PROMPT] * 64, DecodeConfig(1, 24), samples).tokens
    draft = copy.copy(drafts["good"])
    draft.ngram_table = NgramTable.build(answers, vocab_size=V, sizes=(2,), min_count=1)
    config = DecodeConfig(block_size=4, max_new_tokens=16, lookup=4)
    rows = [SamplingParams(1.0, seed=i) for i in range(32)]
    with_table = spec_generate(target, draft, [PROMPT] * 32, config, rows)
    without = spec_generate(target, drafts["good"], [PROMPT] * 32, config, rows)
    assert with_table.tokens == without.tokens
    lookup_tokens = [sum(r.lookup_accepted for r in run.rounds) for run in (with_table, without)]
    assert lookup_tokens[0] == lookup_tokens[1]
    greedy = [spec_generate(target, d, [PROMPT], config).rounds for d in (draft, drafts["good"])]
    assert sum(r.lookup_accepted for r in greedy[0]) > sum(r.lookup_accepted for r in greedy[1])


def test_the_check_detects_lookup_paths_taken_without_rejection(small_vocab, monkeypatch):
    """Power check: committing every real lookup token (a lookup path accepted
    as greedy verification would, with no rejection) must fail the same test."""
    target, drafts = small_vocab

    def take_lookup(block, valid, tree, draft_probs, target_probs, generators):
        verdict = verify_sampled_tree(block, valid, tree, draft_probs, target_probs, generators)
        found = valid[:, tree.lookup_start :].sum(1)
        end = torch.where(found > 0, tree.lookup_start + found - 1, verdict.path_end)
        depth = tree.depths(block.device)[end]
        rows = torch.arange(len(block))
        ancestry = tree.visibility(block.device)
        return Verdict(depth, target_probs[rows, end].argmax(-1), ancestry[end], end, verdict.draft_accepted)

    monkeypatch.setattr(session, "verify_sampled_tree", take_lookup)
    params = SamplingParams(temperature=1.0)
    counts, _ = spec_joint(target, drafts["good"], params, "sample", prompt=LOOKUP_PROMPT, lookup=4)
    assert chi_square_pvalue(counts, exact_joint(target, params, prompt=LOOKUP_PROMPT)) < ALPHA


@pytest.mark.parametrize("warp", sorted(WARPS))
@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_first_slot_branches_keep_sampling_exact(small_vocab, warp, proposal):
    """Sampled rows verify the draft's runner-ups for the first slot (k = 3)
    beside the chain and a lookup path: the output still follows the target's
    distribution, and alternates do get committed."""
    target, drafts = small_vocab
    params = SamplingParams(**WARPS[warp])
    counts, result = spec_joint(target, drafts["good"], params, proposal, prompt=LOOKUP_PROMPT, lookup=4, branches=3)
    assert chi_square_pvalue(counts, exact_joint(target, params, prompt=LOOKUP_PROMPT)) > ALPHA
    assert sum(r.branches_taken for r in result.rounds) > ROWS // 100


def test_the_check_detects_alternates_taken_without_rejection(small_vocab, monkeypatch):
    """Power check: committing the first alternate whenever no candidate was
    accepted (no rejection test for it) must fail the same test."""
    target, drafts = small_vocab

    def take_alternate(block, valid, tree, draft_probs, target_probs, generators):
        verdict = verify_sampled_tree(block, valid, tree, draft_probs, target_probs, generators)
        end = torch.where(verdict.num_accepted == 0, tree.chain, verdict.path_end)
        rows = torch.arange(len(block))
        following = sample_rows(target_probs[rows, end], generators)
        ancestry = tree.visibility(block.device)
        return Verdict(tree.depths(block.device)[end], following, ancestry[end], end, verdict.draft_accepted)

    monkeypatch.setattr(session, "verify_sampled_tree", take_alternate)
    params = SamplingParams(temperature=1.0)
    counts, _ = spec_joint(target, drafts["good"], params, "sample", branches=3)
    assert chi_square_pvalue(counts, exact_joint(target, params)) < ALPHA


def test_seeded_rows_are_reproducible_and_greedy_rows_stay_exact(qwen_pair):
    target, draft = qwen_pair
    prompts = random_prompts(4, seed=6)
    rows = [SamplingParams(), SamplingParams(1.0, seed=5), SamplingParams(0.7, top_k=10, seed=6), SamplingParams()]
    config = DecodeConfig(block_size=8, max_new_tokens=20, proposal="sample")
    first = spec_generate(target, draft, prompts, config, rows)
    second = spec_generate(target, draft, prompts, config, rows)
    assert first.tokens == second.tokens
    for i in (0, 3):
        assert first.tokens[i] == reference_greedy(target, prompts[i], 20)


def test_min_tokens_keeps_suppressed_tokens_out_exactly(small_vocab):
    """The first ``min_tokens`` tokens never are a suppressed one, greedy
    speculation equals plain decoding under the same rule, and sampled
    speculation matches the target's distribution with those tokens masked."""
    target, drafts = small_vocab
    plain = spec_generate(target, None, [PROMPT], DecodeConfig(block_size=1, max_new_tokens=6)).tokens[0]
    banned, minimum = plain[0], 2  # greedy decoding opens with it: the rule must change the output
    rule = SamplingParams(min_tokens=minimum, suppressed=(banned,))
    reference = spec_generate(target, None, [PROMPT], DecodeConfig(1, 6), rule).tokens[0]
    assert banned not in reference[:minimum] and reference != plain
    assert spec_generate(target, drafts["good"], [PROMPT], DecodeConfig(4, 6), rule).tokens[0] == reference
    # With alternates and lookup paths, each slot suppressed by its own depth.
    tree = DecodeConfig(4, 6, branches=3, lookup=4)
    mixed = spec_generate(target, drafts["good"], [PROMPT, LOOKUP_PROMPT], tree, [rule, SamplingParams()])
    assert mixed.tokens[0] == reference

    def mask(logits, prefix):
        return logits.masked_fill(torch.arange(V) == banned, float("-inf")) if len(prefix) < minimum else logits

    exact = exact_joint(target, SamplingParams(1.0), transform=mask)
    rows = [SamplingParams(1.0, seed=i, min_tokens=minimum, suppressed=(banned,)) for i in range(ROWS)]
    for config in (DecodeConfig(4, K, proposal="sample"), DecodeConfig(4, K, proposal="sample", branches=3)):
        result = spec_generate(target, drafts["good"], [PROMPT] * ROWS, config, rows)
        codes = torch.tensor([sum(t * V ** (K - 1 - i) for i, t in enumerate(tokens)) for tokens in result.tokens])
        assert chi_square_pvalue(torch.bincount(codes, minlength=V**K), exact) > ALPHA
    assert sum(r.branches_taken for r in result.rounds) > ROWS // 100


def test_a_point_mass_row_is_taken_without_a_draw():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 3.0, 0.0, 0.0]])
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    states = [g.get_state() for g in generators]
    tokens = sample_rows(probs, generators)
    assert tokens[0] == 2 and tokens[2] == 1  # one-hot rows (unnormalised too) keep their token
    assert torch.equal(generators[0].get_state(), states[0]) and torch.equal(generators[2].get_state(), states[2])
    u = torch.rand(1, generator=torch.Generator().manual_seed(1))[0]  # row 1's draw: its generator's uniform
    assert tokens[1] == int(u * 4) and not torch.equal(generators[1].get_state(), states[1])


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_zero():
    probs = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.5, 0.0], [0.2, 0.0, 0.0, 0.0, 0.0, 0.8]])
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(2, 20000, generator=gen)
    tokens = inverse_cdf(probs[:, None].expand(2, 20000, 6), u)
    for row in range(2):
        assert chi_square_pvalue(torch.bincount(tokens[row], minlength=6), probs[row]) > ALPHA
    # A draw that rounds up to the total lands on the last token with mass, not past it.
    edge = inverse_cdf(probs, torch.tensor([1.0, 1.0]))
    assert edge.tolist() == [4, 5]
