"""DecodeSession: rows join and leave between rounds, block size changes per
round, and every row still gets exactly the target's greedy tokens."""

import copy
import itertools

import pytest
import torch
from builders import random_prompts, reference_greedy

from speculative.sampling import SamplingParams
from speculative.session import DEFERRED_CONTEXT_LIMIT, DecodeSession

NEW = 24


def decode_until(session: DecodeSession, outputs: dict, limit: int, block_sizes) -> None:
    """Run rounds until every row has ``limit`` tokens, removing full rows."""
    for b in block_sizes:
        done = [k for k, v in outputs.items() if len(v) >= limit and k in session.rows.keys]
        session.remove(done)
        if not len(session):
            return
        _, emitted = session.step(b)
        for key, tokens in emitted.items():
            outputs[key] += tokens


def test_rows_joining_mid_flight_get_their_own_greedy_tokens(qwen_pair):
    target, draft = qwen_pair
    prompts = random_prompts(7, seed=31, min_len=3, max_len=18)
    session = DecodeSession(target, draft, compact_slack=8)
    outputs = {}
    schedule = itertools.cycle([16, 4, 1, 8, 2])
    for wave in ([0, 1, 2], [3, 4], [5, 6]):  # three arrivals, a few rounds apart
        first = session.add(wave, [prompts[i] for i in wave], [SamplingParams()] * len(wave))
        outputs.update({k: [t] for k, t in first.items()})
        decode_until(session, outputs, NEW, itertools.islice(schedule, 3))
    decode_until(session, outputs, NEW, schedule)
    assert len(session) == 0 and session.batch is None
    for i, prompt in enumerate(prompts):
        assert outputs[i][:NEW] == reference_greedy(target, prompt, NEW)


def test_identical_prompts_are_prefilled_once_and_decode_as_their_own_rows(qwen_pair, monkeypatch):
    """Rows joining with the same prompt share one prefill row (its caches are
    copied): each still decodes the target's greedy tokens, and seeded sampled
    copies draw as they would with a prefill of their own."""
    target, draft = qwen_pair
    a, b = random_prompts(2, seed=41, min_len=5, max_len=12)
    prefill_rows, forward = [], target.forward

    def spy(ids, *args, **kwargs):
        if kwargs.get("block_visible") is None and ids.shape[1] > 1 and not prefill_rows:
            prefill_rows.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    sampled = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    session = DecodeSession(target, draft)
    params = [SamplingParams(), sampled[0], SamplingParams(), sampled[1]]
    outputs = {k: [t] for k, t in session.add([0, 1, 2, 3], [a, a, b, a], params).items()}
    assert prefill_rows == [2]
    decode_until(session, outputs, NEW, itertools.cycle([4, 1, 8]))
    assert outputs[0][:NEW] == reference_greedy(target, a, NEW) and outputs[2][:NEW] == reference_greedy(target, b, NEW)
    for key, params in ((1, sampled[0]), (3, sampled[1])):
        alone = DecodeSession(target, draft)
        own = {key: [alone.add([key], [a], [params])[key]]}
        decode_until(alone, own, NEW, itertools.cycle([4, 1, 8]))
        assert own[key][:NEW] == outputs[key][:NEW]


def test_logprobs_are_the_targets_own_whichever_path_committed_the_token(qwen_pair):
    """A row asking for logprobs gets, for each token it emits (the first one
    from the prefill, then chain, alternate and lookup tokens and plain steps),
    the target's log-probability after the exact prefix and its top tokens; a
    row that does not ask gets none."""
    target, draft = qwen_pair
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: lookup paths get taken
    session = DecodeSession(target, draft, branches=4, lookup=4)
    first = session.add(["a", "b"], [prompt, prompt[:5]], [SamplingParams(logprobs=3), SamplingParams()])
    assert list(session.first_logprobs) == ["a"]
    tokens, got, paths = [first["a"]], [session.first_logprobs["a"]], 0
    for block_size in itertools.islice(itertools.cycle([4, 1, 8, 16]), 10):
        stats, emitted = session.step(block_size)
        tokens += emitted["a"]
        got += stats.logprobs["a"]
        paths += stats.lookup_accepted + stats.branches_taken
        assert list(stats.logprobs) == ["a"]
    assert paths > 0 and [g.token for g in got] == tokens
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for j, g in enumerate(got):
        assert g.logprob == pytest.approx(reference[j, tokens[j]].item(), abs=1e-4)
        assert [t for t, _ in g.top] == reference[j].topk(3).indices.tolist() and g.top[0][0] == tokens[j]


def prompt_reference(target, prompt: list[int]) -> torch.Tensor:
    """The target's log-probabilities after each prompt prefix, from one full forward [len - 1, V]."""
    with torch.no_grad():
        return torch.log_softmax(target.model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def assert_scores_prompt(scored, target, prompt: list[int], top: int) -> None:
    """``scored`` holds, for each prompt token after the first, its log-probability
    and the ``top`` best tokens' as one full forward over the prompt gives them."""
    reference = prompt_reference(target, prompt)
    assert [s.token for s in scored] == prompt[1:]
    for j, s in enumerate(scored):
        assert s.logprob == pytest.approx(reference[j, prompt[j + 1]].item(), abs=1e-4)
        assert [t for t, _ in s.top] == reference[j].topk(top).indices.tolist()


def test_prompt_logprobs_score_each_prompt_token_in_a_batched_and_a_chunked_prefill(qwen_pair):
    """Rows asking for ``prompt_logprobs`` get their prompt tokens scored by the
    target (left padding, a shared prefill with another top count, chunks of
    any size change nothing); rows that do not ask get none, and their first
    tokens are what a prefill without scoring draws."""
    target, draft = qwen_pair
    short, long = random_prompts(2, seed=52, min_len=6, max_len=17)
    session = DecodeSession(target, draft)
    params = [SamplingParams(prompt_logprobs=2), SamplingParams(prompt_logprobs=0), SamplingParams(), SamplingParams()]
    first = session.add(["a", "b", "c", "d"], [long, long, short, long], params)
    assert sorted(session.prompt_logprobs) == ["a", "b"]
    assert_scores_prompt(session.prompt_logprobs["a"], target, long, 2)
    assert_scores_prompt(session.prompt_logprobs["b"], target, long, 0)
    plain = DecodeSession(target, draft).add(["c", "d"], [short, long], [SamplingParams()] * 2)
    assert plain == {"c": first["c"], "d": first["d"]} and first["a"] == first["d"]
    for chunk in (1, 5, len(long)):
        part = session.start_prefill(long, prompt_logprobs=3)
        while not session.prefill_chunk(part, chunk):
            pass
        joined = session.add_prefilled([f"e{chunk}", f"f{chunk}"], part, [SamplingParams(prompt_logprobs=1)] * 2)
        assert joined[f"e{chunk}"] == first["d"]
        assert_scores_prompt(session.prompt_logprobs[f"f{chunk}"], target, long, 1)
    part = session.start_prefill(long, prompt_logprobs=1)
    session.prefill_chunk(part, len(long))
    with pytest.raises(ValueError, match="prompt log-probabilities"):
        session.add_prefilled(["g"], part, [SamplingParams(prompt_logprobs=2)])
    session.add(["h"], [[7]], [SamplingParams(prompt_logprobs=1)])
    assert session.prompt_logprobs == {"h": []}


def test_block_size_one_rounds_keep_the_draft_context(qwen_pair):
    """Plain rounds still feed the draft: speculative rounds after them accept
    exactly what they accept for a row prefilled with the same tokens."""
    target, draft = qwen_pair
    prompt = random_prompts(1, seed=12, min_len=8, max_len=8)[0]
    mixed = DecodeSession(target, draft)
    tokens = [mixed.add(["a"], [prompt], [SamplingParams()])["a"]]
    for _ in range(6):
        tokens += mixed.step(1)[1]["a"]
    fresh = DecodeSession(target, draft)
    assert fresh.add(["a"], [prompt + tokens[:-1]], [SamplingParams()])["a"] == tokens[-1]
    for _ in range(6):
        (mixed_stats, mixed_out), (fresh_stats, fresh_out) = mixed.step(16), fresh.step(16)
        assert mixed_out == fresh_out and mixed_stats.committed == fresh_stats.committed
        tokens += mixed_out["a"]
    assert tokens == reference_greedy(target, prompt, len(tokens))
    assert mixed.batch.draft_cache.layers[0].keys.shape[2] == mixed.batch.num_slots


def test_session_rejects_bad_use(qwen_pair):
    target, draft = qwen_pair
    session = DecodeSession(target, draft)
    with pytest.raises(ValueError, match="no rows"):
        session.step(4)
    session.add(["x"], [[1, 2, 3]], [SamplingParams()])
    with pytest.raises(ValueError, match="unique"):
        session.add(["x"], [[4]], [SamplingParams()])
    with pytest.raises(ValueError, match="block_size"):
        session.step(17)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        session.add(["y"], [[10_000]], [SamplingParams()])
    with pytest.raises(ValueError, match="block_size"):
        DecodeSession(target).step(2)
    session.remove(["x", "unknown"])
    assert len(session) == 0


def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefilled_at_once(qwen_pair):
    """A long prompt prefilled a few tokens at a time while another row
    decodes joins with the same first token and the target's greedy tokens,
    and drafts exactly what it drafts after a one-forward prefill."""
    target, draft = qwen_pair
    short, long = random_prompts(2, seed=41, min_len=20, max_len=20)
    chunked, whole = DecodeSession(target, draft), DecodeSession(target, draft)
    outputs = {"s": [chunked.add(["s"], [short], [SamplingParams()])["s"]]}
    part = chunked.start_prefill(long)
    chunks = 0
    while not chunked.prefill_chunk(part, 6):  # 20 tokens: 6 + 6 + 6 + 2
        chunks += 1
        outputs["s"] += chunked.step(4)[1]["s"]  # the running row decodes between chunks
    assert chunks == 3 and part.done == len(long)
    outputs["l"] = [chunked.add_prefilled(["l"], part, [SamplingParams()])["l"]]
    assert outputs["l"] == [whole.add(["l"], [long], [SamplingParams()])["l"]]
    chunked.remove(["s"])
    for b in (16, 4, 16):
        (chunked_stats, chunked_out), (whole_stats, whole_out) = chunked.step(b), whole.step(b)
        assert chunked_out == whole_out and chunked_stats.committed == whole_stats.committed
        outputs["l"] += chunked_out["l"]
    assert outputs["l"] == reference_greedy(target, long, len(outputs["l"]))


def test_a_chunked_prompt_joins_as_several_rows(qwen_pair):
    """One chunked prefill, joined once per key (an API call's choices): every
    row decodes the target's greedy tokens."""
    target, draft = qwen_pair
    prompt = random_prompts(1, seed=43, min_len=20, max_len=20)[0]
    session = DecodeSession(target, draft)
    part = session.start_prefill(prompt)
    while not session.prefill_chunk(part, 6):
        pass
    outputs = {k: [t] for k, t in session.add_prefilled(["a", "b"], part, [SamplingParams()] * 2).items()}
    decode_until(session, outputs, NEW, itertools.cycle([4, 16]))
    assert outputs["a"][:NEW] == outputs["b"][:NEW] == reference_greedy(target, prompt, NEW)


def test_a_partial_prefill_refuses_to_join_early_or_twice(qwen_pair):
    target, draft = qwen_pair
    session = DecodeSession(target, draft)
    part = session.start_prefill([1, 2, 3, 4])
    with pytest.raises(ValueError, match="not prefilled"):
        session.add_prefilled(["p"], part, [SamplingParams()])
    assert session.prefill_chunk(part, 8)
    session.add_prefilled(["p"], part, [SamplingParams()])
    with pytest.raises(ValueError, match="joined already"):
        session.add_prefilled(["q"], part, [SamplingParams()])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        session.start_prefill([10_000])
    assert len(session) == 1


def test_plain_rounds_project_the_draft_context_at_the_next_drafting_round(qwen_pair, monkeypatch):
    """A plain round's draft context waits: the next drafting round projects
    every waiting token in one call (then its own block), and a long plain
    stretch projects once per DEFERRED_CONTEXT_LIMIT rounds."""
    target, draft = qwen_pair
    projected = []
    context_kv = draft.context_kv
    monkeypatch.setattr(draft, "context_kv", lambda f, p: projected.append(p.shape[1]) or context_kv(f, p))
    session = DecodeSession(target, draft)
    session.add(["a", "b"], random_prompts(2, seed=5, min_len=4, max_len=9), [SamplingParams()] * 2)
    projected.clear()  # the prompts'
    for _ in range(5):
        session.step(1)
    assert projected == []
    session.step(4)
    assert projected == [5, 4]
    assert session.batch.draft_cache.layers[0].keys.shape[2] == session.batch.num_slots
    projected.clear()
    for _ in range(DEFERRED_CONTEXT_LIMIT + 1):
        session.step(1)
    assert projected == [DEFERRED_CONTEXT_LIMIT]


def test_draft_vocabulary_proposals_equal_the_full_vocabularys_choice(qwen_pair):
    """With a draft vocabulary and nothing adjusting the logits, a round chooses
    drafts and first-slot alternates among the K columns (no scatter into V):
    the same tokens as the argmax and runner-ups of the full-vocabulary logits;
    a penalised row takes the full-vocabulary path and gets them too."""
    target, draft = qwen_pair
    draft = copy.deepcopy(draft)
    draft.set_draft_vocab(torch.arange(0, target.vocab_size, 3))
    draft_logits, hidden = draft.draft_logits, []

    def recording(states, *args, **kwargs):  # keeps the draft's output states of the round
        hidden.append(states)
        return draft_logits(states, *args, **kwargs)

    draft.draft_logits = recording
    prompts = random_prompts(3, seed=40, min_len=4, max_len=12)
    for params in (SamplingParams(), SamplingParams(repetition_penalty=1.0, frequency_penalty=0.5)):
        session = DecodeSession(target, draft, branches=4)
        session.add([0, 1, 2], prompts, [params] * 3)
        positions = session.batch.lengths[:, None] + torch.arange(4)
        with torch.inference_mode():
            drafts, q, alternates = session._propose(positions, True)
            full = session._adjusted(draft_logits(hidden[-1], target))
        assert q is None and torch.equal(drafts, full.argmax(-1))
        assert torch.equal(alternates, full[:, 0].topk(4).indices[:, 1:])
        assert torch.isin(torch.cat([drafts, alternates], 1), draft.draft_vocab_ids).all()


def test_a_preempted_row_resumes_exactly_where_it_left(qwen_pair):
    """Rows taken out mid-decode (``preempt``: caches freed), rebuilt a few
    tokens at a time from the tokens their caches held while the others decode,
    and resumed, emit exactly what they emit never taken out: a greedy row, a
    seeded sampled one with penalties, one whose own text feeds lookup paths.
    The caches held the prompt and every emitted token before the anchor."""
    target, draft = qwen_pair
    prompts = [*random_prompts(3, seed=47, min_len=6, max_len=14), [5, 6, 7, 5, 6, 7, 5, 6]]
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=3, presence_penalty=0.5),
        SamplingParams(temperature=0.8, seed=4),
        SamplingParams(),
    ]
    keys = list(range(len(prompts)))
    left_at: dict = {}

    def decode(preempting: bool) -> dict:
        session = DecodeSession(target, draft, branches=4, lookup=4)
        outputs = {k: [t] for k, t in session.add(keys, prompts, params).items()}
        for round_ in range(12):  # one block size throughout: sampled rows draw as they would alone
            if preempting and round_ == 3:
                taken = session.preempt([1, 3])
                left_at.update({key: len(outputs[key]) for key in taken})
                assert sorted(taken) == [1, 3] and session.rows.keys == [0, 2]
                for key, row in taken.items():
                    assert row.tokens == prompts[key] + outputs[key][:-1]
                parts = {key: session.start_prefill(row.tokens) for key, row in taken.items()}
            for key, part in list(parts.items()) if preempting and round_ >= 3 else ():
                if session.prefill_chunk(part, 5):
                    session.resume(part, taken[key])
                    del parts[key]
            for key, tokens in session.step(4)[1].items():
                outputs[key] += tokens
            if preempting and round_ == 3:
                assert set(outputs) - set(session.rows.keys) == {1, 3}  # still rebuilding
        assert sorted(session.rows.keys) == keys
        for key, cached in zip(session.rows.keys, session.rows.cached, strict=True):
            assert cached == prompts[key] + outputs[key][:-1]
        return outputs

    kept, preempted = decode(False), decode(True)
    shortest = min(map(len, preempted.values()))
    for key in keys:
        assert preempted[key][:shortest] == kept[key][:shortest], key
    assert all(len(preempted[key]) >= at + 5 for key, at in left_at.items())  # resumed rows decoded on
    assert preempted[0] == reference_greedy(target, prompts[0], len(preempted[0]))


def test_resume_refuses_a_row_not_rebuilt(qwen_pair):
    target, draft = qwen_pair
    session = DecodeSession(target, draft)
    session.add(["a", "b"], random_prompts(2, seed=53, min_len=8, max_len=8), [SamplingParams()] * 2)
    session.step(4)
    row = session.preempt(["a"])["a"]
    part = session.start_prefill(row.tokens)
    with pytest.raises(ValueError, match="not rebuilt"):
        session.resume(part, row)
    other = session.start_prefill(row.tokens[:-1])
    session.prefill_chunk(other, 100)
    with pytest.raises(ValueError, match="not the preempted row's"):
        session.resume(other, row)
    session.prefill_chunk(part, 100)
    session.resume(part, row)
    assert sorted(session.rows.keys) == ["a", "b"]
    with pytest.raises(ValueError, match="joined already"):
        session.resume(part, row)
