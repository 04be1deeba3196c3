"""Greedy speculative decoding is token-identical to target-only greedy decoding."""

import copy

import pytest
import torch
from builders import VOCAB, random_prompts, reference_greedy, tiny_draft, tiny_target

from speculative.config import DraftTargetMismatch
from speculative.decode import DecodeConfig, spec_generate
from speculative.ngram_table import NgramTable
from speculative.sampling import SamplingParams, greedy_tokens
from speculative.session import DecodeSession
from speculative.train.draft_vocab import frequent_token_ids, token_coverage
from speculative.train.objective import simulated_greedy_rounds
from speculative.tree import DraftTree
from speculative.verify import verify_greedy_tree

NEW_TOKENS = 32
PROMPTS = random_prompts(24, seed=11, min_len=2, max_len=24)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair_and_references(request):
    pair = request.getfixturevalue(f"{'qwen' if request.param == 'qwen3' else 'llama'}_pair")
    target, _ = pair
    return pair, [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def reduced_vocab(qwen_pair):
    """The trained Qwen3 pair's draft restricted to the quarter of the vocabulary
    its target's greedy outputs use most, and those outputs."""
    target, draft = qwen_pair
    references = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    reduced = copy.deepcopy(draft)
    reduced.set_draft_vocab(frequent_token_ids((t for r in references for t in r), VOCAB // 4, vocab_size=VOCAB))
    return target, reduced, references


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_batch_one_matches_target_greedy(pair_and_references, block_size):
    (target, draft), references = pair_and_references
    taus = []
    for prompt, reference in zip(PROMPTS, references, strict=True):
        result = spec_generate(target, draft, [prompt], DecodeConfig(block_size=block_size, max_new_tokens=NEW_TOKENS))
        assert result.tokens[0] == reference
        taus.append(result.mean_acceptance_length)
    # The trained draft really gets drafts accepted, so the accept path is exercised.
    assert max(taus) > 1.5


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("compact_slack", [0, 64])
def test_ragged_batches_match_target_greedy(pair_and_references, block_size, compact_slack):
    (target, draft), references = pair_and_references
    config = DecodeConfig(block_size=block_size, max_new_tokens=NEW_TOKENS, compact_slack=compact_slack)
    for start in range(0, len(PROMPTS), 6):
        result = spec_generate(target, draft, PROMPTS[start : start + 6], config)
        assert result.tokens == references[start : start + 6]
        accepted = {n for r in result.rounds for n in r.committed}
        assert len(accepted) > 1 or block_size == 2


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_reduced_draft_vocabulary_matches_target_greedy(reduced_vocab, block_size, monkeypatch):
    """A draft proposing from a quarter of the vocabulary: batched greedy output
    is still the target's, every draft is a token of the subset, drafts get
    accepted, and the outputs' tokens outside the subset come from the target."""
    target, draft, references = reduced_vocab
    proposed = []
    original = DecodeSession._propose

    def spy(self, *args):
        drafts, q, alternates = original(self, *args)
        proposed.append(drafts.flatten())
        return drafts, q, alternates

    monkeypatch.setattr(DecodeSession, "_propose", spy)
    config = DecodeConfig(block_size=block_size, max_new_tokens=NEW_TOKENS)
    taus = []
    for start in range(0, len(PROMPTS), 6):
        result = spec_generate(target, draft, PROMPTS[start : start + 6], config)
        assert result.tokens == references[start : start + 6]
        taus.append(result.mean_acceptance_length)
    assert torch.isin(torch.cat(proposed), draft.draft_vocab_ids).all()
    assert max(taus) > 1.2, taus
    assert token_coverage((t for r in references for t in r), draft.draft_vocab_ids, vocab_size=VOCAB) < 0.95


def test_random_draft_is_still_lossless():
    target, draft = tiny_target(seed=4), tiny_draft(seed=9)
    config = DecodeConfig(block_size=16, max_new_tokens=24)
    result = spec_generate(target, draft, PROMPTS[:8], config)
    assert result.tokens == [reference_greedy(target, p, 24) for p in PROMPTS[:8]]


def test_plain_decoding_needs_no_draft(qwen_pair):
    target, _ = qwen_pair
    result = spec_generate(target, None, PROMPTS[:4], DecodeConfig(block_size=1, max_new_tokens=16))
    assert result.tokens == [reference_greedy(target, p, 16) for p in PROMPTS[:4]]
    assert all(r.committed == [1] * r.batch_size for r in result.rounds)


def test_stop_tokens_and_length_limits(qwen_pair):
    target, draft = qwen_pair
    references = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS[:6]]
    stop = references[0][5]
    result = spec_generate(
        target, draft, PROMPTS[:6], DecodeConfig(block_size=8, max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,))
    )
    for tokens, reason, reference in zip(result.tokens, result.finish_reasons, references, strict=True):
        if stop in reference:
            cut = reference.index(stop) + 1
            assert (tokens, reason) == (reference[:cut], "stop")
        else:
            assert (tokens, reason) == (reference, "length")
    assert result.finish_reasons[0] == "stop" and len(result.tokens[0]) <= 6
    short = spec_generate(target, draft, PROMPTS[:3], DecodeConfig(block_size=16, max_new_tokens=3))
    assert short.tokens == [r[:3] for r in references[:3]]
    assert short.finish_reasons == ["length"] * 3


def test_round_statistics_are_consistent(qwen_pair):
    target, draft = qwen_pair
    result = spec_generate(target, draft, PROMPTS[:5], DecodeConfig(block_size=8, max_new_tokens=NEW_TOKENS))
    for r in result.rounds:
        assert all(1 <= a <= 8 for a in r.committed)
        assert len(r.accepted_per_position) == len(r.verified_per_position) == 7
        # Acceptance is a prefix: position k+1 is accepted only if position k was.
        assert all(x >= y for x, y in zip(r.accepted_per_position, r.accepted_per_position[1:], strict=False))
        assert sum(r.accepted_per_position) == sum(r.committed) - r.batch_size
        assert r.draft_seconds >= 0 and r.verify_seconds > 0
    assert 1.0 <= result.mean_acceptance_length <= 8.0


@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_serving_accepts_what_the_drafts_packed_predictions_allow(qwen_pair, reduced_vocab, vocabulary):
    """The decode loop's acceptance per round equals the chain of rounds
    simulated from the training objective's packed forward over the finished
    output: the serving path gives the draft the same context (strictly before
    the anchor, no token lost or shifted between rounds) as training does. With
    a reduced draft vocabulary the simulation maps its K-way guesses back to
    token ids, as serving's scattered logits do."""
    target, draft = qwen_pair if vocabulary == "full" else reduced_vocab[:2]
    b = draft.block_size
    accepted_rounds = 0
    for prompt in random_prompts(8, seed=5, min_len=8, max_len=8):  # the distribution the draft was distilled on
        result = spec_generate(target, draft, [prompt], DecodeConfig(block_size=b, max_new_tokens=NEW_TOKENS))
        served = [r.committed[0] - 1 for r in result.rounds]  # drafts accepted (committed minus the bonus)
        simulated = simulated_greedy_rounds(draft, target, prompt + result.tokens[0], len(prompt))
        # The last round may accept drafts past max_new_tokens that the output then cuts.
        assert served[:-1] == simulated[: len(served) - 1]
        accepted_rounds += sum(n > 0 for n in served[:-1])
    assert accepted_rounds >= 20  # the comparison covers rounds that accepted drafts


def test_bad_inputs_fail_clearly(qwen_pair):
    target, draft = qwen_pair
    with pytest.raises(ValueError, match="needs a draft"):
        spec_generate(target, None, [[1, 2]], DecodeConfig(block_size=4))
    with pytest.raises(ValueError, match="exceeds the draft's trained block"):
        spec_generate(target, draft, [[1, 2]], DecodeConfig(block_size=32))
    with pytest.raises(ValueError, match="context length"):
        spec_generate(target, draft, [[1] * 500], DecodeConfig(max_new_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        spec_generate(target, draft, [[1], []], DecodeConfig())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        spec_generate(target, draft, [[1, 999]], DecodeConfig())
    with pytest.raises(ValueError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="one dtype"):
        spec_generate(target, tiny_draft().double(), [[1, 2]], DecodeConfig(block_size=4))
    with pytest.raises(DraftTargetMismatch, match="layer count"):
        spec_generate(tiny_target(layers=6), draft, [[1, 2]], DecodeConfig(block_size=4))


def test_target_with_sliding_window_layers_is_lossless():
    """The target's sliding layers get their own window mask (checked against
    transformers' generate, which crops its sliding caches)."""
    target = tiny_target(use_sliding_window=True, sliding_window=5, max_window_layers=2, seed=2)
    assert "sliding_attention" in target.config.layer_types
    draft = tiny_draft(seed=3)
    prompts = PROMPTS[:6]
    result = spec_generate(target, draft, prompts, DecodeConfig(block_size=4, max_new_tokens=20, compact_slack=0))
    assert result.tokens == [reference_greedy(target, p, 20) for p in prompts]


@pytest.mark.gpu
def test_greedy_on_cuda_matches_target_greedy(qwen_pair):
    target, draft = qwen_pair
    cuda_target = type(target)(target.model.to("cuda"))
    try:
        result = spec_generate(
            cuda_target, draft.to("cuda"), PROMPTS[:8], DecodeConfig(block_size=16, max_new_tokens=NEW_TOKENS)
        )
        assert result.tokens == [reference_greedy(cuda_target, p, NEW_TOKENS) for p in PROMPTS[:8]]
    finally:
        target.model.to("cpu")
        draft.to("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_are_the_argmax_in_any_precision_first_on_ties(dtype):
    logits = torch.randn(3, 4, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 1, [7, 500]] = 100  # a tie: the first index wins
    logits[2, 3] = 0  # all tie
    tokens = greedy_tokens(logits)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert (tokens[0, 1].item(), tokens[2, 3].item()) == (7, 0)


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("branches", [2, 4])
def test_first_slot_branches_match_target_greedy(pair_and_references, block_size, branches):
    """Ragged batches that also verify the draft's next most likely tokens for
    the first drafted slot: still the target's greedy output, and alternates
    really get committed (a tree block: each sees only the anchor)."""
    (target, draft), references = pair_and_references
    config = DecodeConfig(block_size=block_size, max_new_tokens=NEW_TOKENS, branches=branches)
    for start in range(0, len(PROMPTS), 6):
        result = spec_generate(target, draft, PROMPTS[start : start + 6], config)
        assert result.tokens == references[start : start + 6]
    assert sum(r.branches_taken for r in result.rounds) > 0


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize(("branches", "lookup"), [(1, 3), (4, 8)])
def test_lookup_paths_match_target_greedy(pair_and_references, block_size, branches, lookup):
    """Ragged batches that also verify an n-gram lookup continuation per row
    (of different lengths, or none) beside the chain and the alternates: still
    the target's greedy output, and lookup paths really commit tokens past
    what the draft's slots accepted, longer than the block at b = 2."""
    (target, draft), references = pair_and_references
    config = DecodeConfig(block_size=block_size, max_new_tokens=NEW_TOKENS, branches=branches, lookup=lookup)
    rounds = []
    for start in range(0, len(PROMPTS), 6):
        result = spec_generate(target, draft, PROMPTS[start : start + 6], config)
        assert result.tokens == references[start : start + 6]
        rounds += result.rounds
    assert sum(r.lookup_accepted for r in rounds) > 0
    assert block_size > 2 or max(max(r.committed) for r in rounds) > block_size


def test_lookup_from_the_draft_table_matches_target_greedy(pair_and_references):
    """Rows whose own text has no n-gram match continue from the draft's corpus
    table (built here from the target's greedy answers to other prompts): still
    the target's greedy output, and the table adds committed lookup tokens."""
    (target, draft), references = pair_and_references
    others = random_prompts(24, seed=12, min_len=2, max_len=24)
    answers = [reference_greedy(target, p, NEW_TOKENS) for p in others]
    with_table = copy.copy(draft)
    with_table.ngram_table = NgramTable.build(answers, vocab_size=target.vocab_size, min_count=1)
    lookup_tokens = {}
    for name, model in (("own text", draft), ("table", with_table)):
        config = DecodeConfig(block_size=4, max_new_tokens=NEW_TOKENS, branches=2, lookup=6)
        result = spec_generate(target, model, PROMPTS, config)
        assert result.tokens == references
        lookup_tokens[name] = sum(r.lookup_accepted for r in result.rounds)
    assert lookup_tokens["table"] > lookup_tokens["own text"]
    off = spec_generate(
        target, with_table, PROMPTS, DecodeConfig(4, NEW_TOKENS, branches=2, lookup=6, lookup_table=False)
    )
    assert sum(r.lookup_accepted for r in off.rounds) == lookup_tokens["own text"]


def test_penalised_rows_take_lookup_paths_and_alternates_exactly(qwen_pair):
    """An alternate's or a lookup path's prefix differs from the chain's, and a
    penalised row's distributions depend on the exact prefix: each slot is
    penalised for its own path, so a penalised row beside an unpenalised one
    commits the same tokens with a tree as with the chain alone, and takes
    paths beside the chain."""
    target, draft = qwen_pair
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams()]
    chain = spec_generate(target, draft, PROMPTS[:2], DecodeConfig(block_size=4, max_new_tokens=NEW_TOKENS), params)
    tree = DecodeConfig(block_size=4, max_new_tokens=NEW_TOKENS, branches=4, lookup=4)
    branched = spec_generate(target, draft, PROMPTS[:2], tree, params)
    assert branched.tokens == chain.tokens
    alone = spec_generate(target, draft, PROMPTS[:1], tree, params[:1])
    assert alone.tokens[0] == chain.tokens[0]
    assert sum(r.branches_taken + r.lookup_accepted for r in alone.rounds) > 0


def test_verify_greedy_tree_commits_the_longest_accepted_path():
    vocab = 10
    tree = DraftTree.build(3, alternates=2, lookup=3)  # slots: anchor, chain 1-2, alternates 3-4, lookup 5-7
    assert tree.parents == (-1, 0, 1, 0, 0, 0, 5, 6)
    block = torch.tensor([[0, 4, 5, 6, 7, 4, 5, 6]] * 5)
    valid = torch.ones(5, 8, dtype=torch.bool)
    valid[4, 7] = False  # row 4 found a lookup of two tokens only
    # Target argmax after each slot's path:
    argmax = torch.tensor(
        [
            [4, 5, 9, 1, 1, 5, 1, 1],  # chain accepted whole (4, 5, bonus 9); lookup's 4 5 too, then 1 != 6
            [7, 2, 2, 3, 8, 1, 1, 1],  # chain fails at 4, alternate 7 (slot 4) holds, its slot says 8
            [4, 3, 2, 3, 3, 5, 6, 2],  # chain stops after 4; lookup 4 5 6 all hold, bonus 2
            [2, 2, 2, 3, 3, 5, 6, 2],  # nothing holds
            [4, 3, 2, 3, 3, 5, 6, 2],  # as row 2, but slot 7 is not real: lookup 4 5, then 6
        ]
    )
    logits = torch.nn.functional.one_hot(argmax, vocab).float()
    verdict = verify_greedy_tree(block, valid, tree, logits)
    assert verdict.num_accepted.tolist() == [2, 1, 3, 0, 2]
    assert verdict.next_token.tolist() == [9, 8, 2, 2, 6]
    assert verdict.draft_accepted.tolist() == [2, 1, 1, 0, 1]
    assert verdict.kept.int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 1],
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 0],
    ]
    # Row 0: the lookup path also accepted two tokens (4, 5): on a tie the chain is kept.
    assert verdict.path_end.tolist()[0] == 2
