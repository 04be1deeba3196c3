"""A decoding session: rows that decode together with one DFlash draft.

Rows join (prefilled in their own forward, then merged into the running batch)
and leave between rounds, and every round may use a different block size, so
an engine can batch continuously and follow a block-size policy. One round, for
every row at once:

  propose: ONE draft forward over ``[anchor, MASK x (b-1)]`` at the row's next b
           positions, against the draft's context cache -> b-1 drafted tokens;
  verify:  ONE target forward over ``[anchor, drafts]`` -> b distributions;
  accept:  greedy prefix match or exact rejection sampling (``speculative.verify``);
  commit:  the anchor and the accepted drafts stay in both caches, the rest of the
           block's slots are masked out; the correction/bonus token becomes the next
           anchor (it enters the caches when it is verified next round).

A round may verify more than the chain in the same forward, as a tree of paths
from the anchor (``speculative.tree``): an n-gram lookup continuation
(``lookup``, ``speculative.lookup``) and the draft's runner-up tokens for the
first slot (``branches``); a greedy row commits the path the target accepts
furthest, a sampled row the path recursive rejection sampling takes
(``verify_sampled_tree``). Rows with penalties or early-stop suppression
too: each slot's distribution is adjusted for its own path (``_adjusted``).

``b = 1`` is plain decoding; the draft's context still grows in such rounds, so
speculation can resume at any later round.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from speculative.batch import RaggedBatch, append_draft_context, draft_context
from speculative.draft import DFlashDraftModel
from speculative.grammar import Grammar, GrammarCompiler, GrammarMatcher
from speculative.logprobs import TokenLogprob, token_logprobs
from speculative.lookup import NgramIndex
from speculative.penalties import TokenHistory, penalize
from speculative.rows import Rows
from speculative.sampling import (
    SamplingParams,
    bias_logits,
    greedy_tokens,
    make_generators,
    probabilities,
    sample_positions,
    sample_rows,
    suppress_early,
)
from speculative.target import TargetModel
from speculative.tree import DraftTree
from speculative.verify import Verdict, verify_greedy, verify_greedy_tree, verify_sampled, verify_sampled_tree

Proposal = Literal["argmax", "sample"]  # how a draft slot's token is chosen: the draft's argmax, or sampled
DEFAULT_COMPACT_SLACK = 64  # wasted cache slots per row that trigger a compaction
DEFERRED_CONTEXT_LIMIT = 64
"""Plain steps whose draft context may wait for one batched projection (``_flush_context``)."""


@dataclass
class RoundStats:
    """One propose/verify round over the batch.

    committed: tokens each row committed this round (accepted tokens + 1), i.e. tau.
    accepted_per_position[k]: rows whose draft at block slot k+1 was accepted
        (the draft's own slots: a longer lookup path does not count here).
    verified_per_position[k]: rows that had a draft at block slot k+1 verified.
    """

    batch_size: int
    block_size: int
    committed: list[int]
    accepted_per_position: list[int]
    verified_per_position: list[int]
    draft_seconds: float
    verify_seconds: float
    branches_taken: int = 0
    """Rows that committed a first-slot alternate instead of their chain."""
    lookup_accepted: int = 0
    """Tokens committed beyond what the draft's slots accepted, by rows whose lookup path went further."""
    logprobs: dict[Hashable, list[TokenLogprob]] = field(default_factory=dict)
    """Per row that asked (``SamplingParams.logprobs``): its emitted tokens' log-probabilities."""

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tau over the rows of this round."""
        return sum(self.committed) / len(self.committed)


def check_pair(target: TargetModel, draft: DFlashDraftModel) -> None:
    """Raise ``DraftTargetMismatch`` (shapes) or ``ValueError`` (device, dtype) when
    ``draft`` cannot run with ``target``."""
    draft.config.check_target(
        hidden_size=target.hidden_size,
        num_layers=target.num_layers,
        embedding_rows=target.embedding_rows,
        vocab_size=target.vocab_size,
        draft_vocab_ids=draft.draft_vocab_ids,
    )
    weight = draft.fc.weight
    if (weight.device, weight.dtype) != (target.device, target.dtype):
        raise ValueError(
            f"draft is on {weight.device} in {weight.dtype} but the target is on {target.device} in "
            f"{target.dtype}: load both on one device with one dtype"
        )


@dataclass
class PartialPrefill:
    """A prompt being prefilled a chunk at a time (``DecodeSession.start_prefill``):
    its caches, the tokens done, the last chunk's final logits [1, V], and
    whether its row has joined (its caches are the batch's then). With
    ``prompt_logprobs`` (top tokens each), ``scored`` gathers the log-probabilities
    of the prompt's tokens after the first as the chunks run."""

    prompt: list[int]
    batch: RaggedBatch
    prompt_logprobs: int | None = None
    done: int = 0
    last_logits: torch.Tensor | None = None
    joined: bool = False
    scored: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class PreemptedRow:
    """A row ``DecodeSession.preempt`` took out, its caches freed: its state, one row."""

    state: Rows

    @property
    def tokens(self) -> list[int]:
        """What its caches held, to prefill again: its prompt and what it emitted before its anchor."""
        return self.state.cached[0]


class DecodeSession:
    """Rows decoding together: ``add`` prefills new rows, ``step`` runs one round
    for all of them, ``remove`` frees finished rows' caches."""

    def __init__(
        self,
        target: TargetModel,
        draft: DFlashDraftModel | None = None,
        *,
        proposal: Proposal = "sample",
        compact_slack: int = DEFAULT_COMPACT_SLACK,
        in_place_cache: bool = True,
        branches: int = 1,
        lookup: int = 0,
        lookup_table: bool = True,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """``branches``: candidates verified for the first drafted slot, the
        draft's most likely tokens there (1: the chain alone; see ``_alternates``).
        ``lookup``: n-gram lookup tokens verified beside the draft (0: none; see ``_lookup``).
        ``lookup_table``: where a greedy row's own text has no match, lookup continues
        from the draft's n-gram table when it ships one (``DFlashDraftModel.ngram_table``).
        ``grammars``: compiles the grammars of rows with structured output
        (``SamplingParams.grammar``; a session without one refuses such rows)."""
        if proposal not in get_args(Proposal):
            raise ValueError(f"proposal must be 'argmax' or 'sample', got {proposal!r}")
        if branches < 1 or lookup < 0:
            raise ValueError(f"branches must be >= 1 and lookup >= 0, got {branches} and {lookup}")
        if draft is not None:
            check_pair(target, draft)
        self.feature_layers = draft.config.target_layer_ids if draft is not None else ()
        self.target, self.draft = target, draft
        self.proposal, self.compact_slack = proposal, compact_slack
        self.branches, self.lookup = branches, lookup if draft is not None else 0
        self.lookup_table = lookup_table
        self.grammars = grammars
        # Appending in place made batch-48 CPU decode steps 5x cheaper than transformers'
        # concatenating layers (kept for comparison: ``in_place_cache=False``).
        self.in_place_cache = in_place_cache
        self.batch: RaggedBatch | None = None
        # Features and positions of the plain (b = 1) steps since the draft context was last projected.
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rows = Rows(
            [],
            torch.empty(0, dtype=torch.long, device=target.device),
            [],
            [],
            TokenHistory.from_prompts([], target.vocab_size, target.device),
            [],
            [],
            [],
            [],
        )
        self.prefill_seconds = 0.0
        self.first_logprobs: dict[Hashable, TokenLogprob] = {}
        """The last ``add`` / ``add_prefilled``'s first tokens' log-probabilities, for the rows that ask."""
        self.prompt_logprobs: dict[Hashable, list[TokenLogprob]] = {}
        """The last ``add`` / ``add_prefilled``'s prompt tokens' log-probabilities (each
        prompt token after the first), for the rows that ask (``SamplingParams.prompt_logprobs``)."""

    def __len__(self) -> int:
        return len(self.rows.keys)

    @property
    def all_greedy(self) -> bool:
        """Every row decodes greedily, so its output is the same under any
        sequence of block sizes (a sampled row's draws depend on the blocks)."""
        return all(p.temperature == 0 for p in self.rows.params)

    @property
    def max_block_size(self) -> int:
        """Largest block a round may use: the draft's trained block, 1 without a draft."""
        return self.draft.block_size if self.draft is not None else 1

    @torch.inference_mode()
    def add(
        self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams]
    ) -> dict[Hashable, int]:
        """Prefill ``prompts`` (one forward for all of them), join them to the batch,
        and return each new row's first generated token. Identical prompts (an
        API call's choices) are prefilled once and their caches copied."""
        if not (len(keys) == len(prompts) == len(sampling)) or not prompts:
            raise ValueError("add needs one key, prompt and sampling setting per row, and at least one row")
        self._check_new(keys, prompts)
        start = _clock(self.target.device)
        unique = {prompt: i for i, prompt in enumerate(dict.fromkeys(tuple(p) for p in prompts))}
        tops: dict[int, int] = {}  # per unique prompt some row scores: the most top tokens a row asks for
        for prompt, s in zip(prompts, sampling, strict=True):
            if s.prompt_logprobs is not None:
                i = unique[tuple(prompt)]
                tops[i] = max(tops.get(i, 0), s.prompt_logprobs)
        batch, last_logits, scored = self._prefill(list(unique), tops)
        self.prompt_logprobs = {
            key: _trimmed(scored[unique[tuple(prompt)]], s.prompt_logprobs)
            for key, prompt, s in zip(keys, prompts, sampling, strict=True)
            if s.prompt_logprobs is not None
        }
        last_logits = _copy_rows(batch, last_logits, [unique[tuple(p)] for p in prompts])
        first = self._join(keys, prompts, sampling, batch, last_logits)
        self.prefill_seconds += _clock(self.target.device) - start
        return first

    def start_prefill(self, prompt: Sequence[int], prompt_logprobs: int | None = None) -> PartialPrefill:
        """A prompt to prefill a chunk at a time (``prefill_chunk``) into caches of
        its own while the batch decodes, then join with ``add_prefilled``: a long
        prompt then stalls the running rows for a chunk at a time, not for all of it.
        ``prompt_logprobs``: score its tokens too, with that many top tokens (the most
        its joining rows ask for)."""
        self._check_new([], [prompt])
        return PartialPrefill(list(prompt), self._new_batch(1), prompt_logprobs)

    @torch.inference_mode()
    def prefill_chunk(self, part: PartialPrefill, max_tokens: int) -> bool:
        """Run the target over the next ``max_tokens`` tokens of ``part``'s prompt
        (both caches grow as in ``add``'s prefill); True once the prompt is done."""
        start = _clock(self.target.device)
        device = self.target.device
        chunk = part.prompt[part.done : part.done + max_tokens]
        ids = torch.tensor([chunk], dtype=torch.long, device=device)
        positions = torch.arange(part.done, part.done + len(chunk), device=device)[None]
        top = part.prompt_logprobs
        logits = self._prefill_forward(part.batch, ids, positions, every_position=top is not None)
        if top is not None:
            # Each position's logits score the prompt's next token, the next chunk's first included.
            following = part.prompt[part.done + 1 : part.done + len(chunk) + 1]
            part.scored += token_logprobs(logits[0, : len(following)], following, top)
        part.last_logits = logits[:, -1]
        part.done += len(chunk)
        self.prefill_seconds += _clock(self.target.device) - start
        return part.done == len(part.prompt)

    @torch.inference_mode()
    def add_prefilled(
        self, keys: Sequence[Hashable], part: PartialPrefill, sampling: Sequence[SamplingParams]
    ) -> dict[Hashable, int]:
        """Join a prompt ``prefill_chunk`` finished as one row per key (an API
        call's choices share one prefill: its caches are copied); returns each
        row's first generated token."""
        if part.last_logits is None or part.done < len(part.prompt):
            raise ValueError("the prompt is not prefilled yet")
        if part.joined:
            raise ValueError("the prompt has joined already")
        if len(keys) != len(sampling) or not keys:
            raise ValueError("add_prefilled needs one sampling setting per key, and at least one key")
        asked = [s.prompt_logprobs for s in sampling if s.prompt_logprobs is not None]
        if asked and (part.prompt_logprobs is None or max(asked) > part.prompt_logprobs):
            raise ValueError("a row asks for more prompt log-probabilities than start_prefill computes")
        self._check_new(keys, [])
        start = _clock(self.target.device)
        self.prompt_logprobs = {
            key: _trimmed(part.scored, s.prompt_logprobs)
            for key, s in zip(keys, sampling, strict=True)
            if s.prompt_logprobs is not None
        }
        last_logits = _copy_rows(part.batch, part.last_logits, [0] * len(keys))
        first = self._join(keys, [part.prompt] * len(keys), sampling, part.batch, last_logits)
        part.joined = True
        self.prefill_seconds += _clock(self.target.device) - start
        return first

    def _check_new(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]]) -> None:
        duplicate = set(keys) & set(self.rows.keys) or len(set(keys)) < len(keys)
        if duplicate:
            raise ValueError("row keys must be unique")
        vocab = self.target.vocab_size
        for prompt in prompts:
            if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"a prompt is empty or has ids outside the vocabulary [0, {vocab})")

    def _join(
        self,
        keys: Sequence[Hashable],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        batch: RaggedBatch,
        last_logits: torch.Tensor,
    ) -> dict[Hashable, int]:
        """Draw the first tokens of prefilled rows from their ``last_logits`` [B, V]
        and merge their ``batch`` into the running one."""
        self._flush_context()
        generators = make_generators(sampling, self.target.device)
        # Only penalised rows keep a token history (the others never read it).
        tracked = [p if s.penalized else () for p, s in zip(prompts, sampling, strict=True)]
        history = TokenHistory.from_prompts(tracked, self.target.vocab_size, self.target.device)
        adjusted = _adjust(last_logits[:, None], sampling, history, [0] * len(sampling))[:, 0]
        grammars = [None if s.grammar is None else self._grammar_matcher(s.grammar) for s in sampling]
        if any(grammars):
            adjusted = adjusted.clone()  # it may be a view of the logits the first logprobs read
        for i, matcher in enumerate(grammars):
            if matcher is not None:
                adjusted[i].masked_fill_(~matcher.mask().to(adjusted.device), float("-inf"))
        first = _sample_first(adjusted, list(sampling), generators)
        for matcher, token in zip(grammars, first.tolist(), strict=True):
            if matcher is not None:
                matcher.advance([token])
        self.first_logprobs = {
            key: token_logprobs(logits[None], [token], s.logprobs)[0]
            for key, s, logits, token in zip(keys, sampling, last_logits, first.tolist(), strict=True)
            if s.logprobs is not None
        }
        history.add([[t] if s.penalized else () for t, s in zip(first.tolist(), sampling, strict=True)])
        table = self.draft.ngram_table if self.draft is not None and self.lookup_table else None
        ngrams = [
            # Greedy rows only: at T = 1 the table's phrasing added 0-0.16 tau, too little for its
            # slots' cost (2-11 % slower, docs/LOG.md); a sampled answer strays from the corpus's.
            NgramIndex([*p, t], table if s.temperature == 0 else None) if self.lookup else None
            for p, t, s in zip(prompts, first.tolist(), sampling, strict=True)
        ]
        cached = [list(p) for p in prompts]
        rows = Rows(list(keys), first, list(sampling), generators, history, [1] * len(keys), ngrams, grammars, cached)
        self._append(batch, rows)
        return dict(zip(keys, rows.anchors.tolist(), strict=True))

    def _append(self, batch: RaggedBatch, rows: Rows) -> None:
        """Put ``rows``, whose caches ``batch`` holds, after this session's rows."""
        if self.batch is None:
            self.batch = batch
        else:
            self.batch.merge(batch)
        self.rows.extend(rows)

    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop these rows and free their cache slots."""
        gone = set(keys)
        keep = [i for i, key in enumerate(self.rows.keys) if key not in gone]
        if len(keep) == len(self.rows.keys):
            return
        self.rows.select(keep)
        if keep:
            self._flush_context()
            self._batch().select_rows(torch.tensor(keep, device=self.target.device))
        else:
            self._deferred.clear()
            self.batch = None

    def preempt(self, keys: Sequence[Hashable]) -> dict[Hashable, PreemptedRow]:
        """Take these rows out of the batch and free their caches, keeping all else
        they decode with (anchor, sampling, random generator, penalty history,
        grammar state, n-gram index, tokens emitted). To continue one, rebuild its
        caches from ``PreemptedRow.tokens`` (``start_prefill``, ``prefill_chunk``)
        and ``resume`` it: it decodes on exactly as if it had never left. This is
        preemption by recomputation (vLLM's, SGLang's retraction): a prefill of
        the row's text later instead of its caches held meanwhile."""
        leaving = set(keys)
        state = self.rows.subset([i for i, key in enumerate(self.rows.keys) if key in leaving])
        self.remove(keys)
        return {key: PreemptedRow(state.subset([i])) for i, key in enumerate(state.keys)}

    def resume(self, part: PartialPrefill, row: PreemptedRow) -> None:
        """Rejoin a preempted ``row`` whose caches ``part`` has rebuilt to the end.
        Its anchor was drawn before it left, so the prefill's last logits go unused."""
        if part.done < len(part.prompt) or part.joined:
            raise ValueError("the row's caches are not rebuilt yet, or have joined already")
        if part.prompt != row.tokens:
            raise ValueError("the prefilled tokens are not the preempted row's")
        self._check_new(row.state.keys, [])
        self._flush_context()
        self._append(part.batch, row.state)
        part.joined = True

    def split(self, keys: Sequence[Hashable]) -> DecodeSession:
        """Move the rows ``keys`` (caches, anchors, sampling and penalty state)
        into a new session of the same models; ``join`` takes them back."""
        moving = set(keys)
        index = [i for i, key in enumerate(self.rows.keys) if key in moving]
        self._flush_context()
        part = type(self)(
            self.target,
            self.draft,
            proposal=self.proposal,
            compact_slack=self.compact_slack,
            in_place_cache=self.in_place_cache,
            branches=self.branches,
            lookup=self.lookup,
            lookup_table=self.lookup_table,
            grammars=self.grammars,
        )
        if index:
            part.batch = copy.deepcopy(self._batch())
            part.batch.select_rows(torch.tensor(index, device=self.target.device))
            part.rows = self.rows.subset(index)
            self.remove([self.rows.keys[i] for i in index])
        return part

    def join(self, other: DecodeSession) -> None:
        """Append ``other``'s rows (a ``split`` part) after this session's rows."""
        if other.batch is None:
            return
        self._flush_context()
        other._flush_context()
        self._append(other.batch, other.rows)
        other.batch, other.rows = None, other.rows.subset([])

    @torch.inference_mode()
    def step(self, block_size: int) -> tuple[RoundStats, dict[Hashable, list[int]]]:
        """One propose -> verify -> accept -> commit round over every row; returns
        its stats and the tokens each row emits (accepted drafts, then the
        correction or bonus). A round that raises leaves the session as it was
        (cache slots, anchors, random generators), so any subset of the rows
        can run it again."""
        if not 1 <= block_size <= self.max_block_size:
            raise ValueError(f"block_size must be in [1, {self.max_block_size}], got {block_size}")
        if not self.rows.keys:
            raise ValueError("no rows to decode")
        batch = self._batch()
        compact = batch.wasted_slots() >= self.compact_slack
        if block_size > 1 or compact or len(self._deferred) >= DEFERRED_CONTEXT_LIMIT:
            self._flush_context()
        if compact:
            batch.compact()
        slots, anchors, deferred = batch.num_slots, self.rows.anchors, len(self._deferred)
        generator_states = [g.get_state() for g in self.rows.generators]
        try:
            return self._round(block_size)
        except Exception:
            batch.truncate(slots)
            del self._deferred[deferred:]
            self.rows.anchors = anchors
            for g, state in zip(self.rows.generators, generator_states, strict=True):
                g.set_state(state)
            raise

    def _round(self, block_size: int) -> tuple[RoundStats, dict[Hashable, list[int]]]:
        batch, device = self._batch(), self.target.device
        start = batch.lengths[:, None]  # the anchor's position
        t0 = _clock(device)
        branching = block_size > 1 and self.branches > 1
        drafts, draft_probs, alternates = self._propose(start + torch.arange(block_size, device=device), branching)
        lookup, lookup_valid = self._lookup(start, block_size > 1 and self.lookup > 0)
        t1 = _clock(device)
        tree = DraftTree.build(block_size, alternates.shape[1], lookup.shape[1])
        block = torch.cat([self.rows.anchors[:, None], drafts, alternates, lookup], dim=1)
        # A slot stands at the anchor's position plus its depth and sees only its own path.
        positions = start + tree.depths(device)
        verified = self.target.forward(
            block,
            positions,
            batch.target_cache,
            batch.slot_positions,
            feature_layers=self.feature_layers,
            block_visible=tree.visibility(device) if tree.width > block_size else None,
        )
        verdict = self._accept(block, tree, lookup_valid, draft_probs, verified.logits)
        kept = verdict.kept_slots(tree.width)
        self._commit(kept, positions, verified.features, block_size)
        t2 = _clock(device)

        verified_tokens = block.tolist()
        emitted = {
            key: [*(t for t, k in zip(row[1:], keep[1:], strict=True) if k), following]
            for key, row, keep, following in zip(
                self.rows.keys, verified_tokens, kept.tolist(), verdict.next_token.tolist(), strict=True
            )
        }
        logprobs = self._logprobs(verified.logits, kept, emitted)
        self.rows.anchors = verdict.next_token
        params = self.rows.params
        self.rows.history.add([t if p.penalized else () for t, p in zip(emitted.values(), params, strict=True)])
        self.rows.generated = [n + len(t) for n, t in zip(self.rows.generated, emitted.values(), strict=True)]
        for matcher, tokens in zip(self.rows.grammars, emitted.values(), strict=True):
            if matcher is not None:
                matcher.advance(tokens)
        for index, tokens in zip(self.rows.ngrams, emitted.values(), strict=True):
            if index is not None:
                index.extend(tokens)
        # The caches took the anchor and the accepted path; the last emitted token is the next anchor.
        for cached, row, tokens in zip(self.rows.cached, verified_tokens, emitted.values(), strict=True):
            cached += [row[0], *tokens[:-1]]
        stats = _round_stats(verdict, tree, t1 - t0, t2 - t1)
        stats.logprobs = logprobs
        return stats, emitted

    def _logprobs(
        self, logits: torch.Tensor, kept: torch.Tensor, emitted: dict[Hashable, list[int]]
    ) -> dict[Hashable, list[TokenLogprob]]:
        """The emitted tokens' log-probabilities for the rows that ask: a row's
        committed slots ``kept`` [B, q], in path order, score the tokens after them."""
        asking = [
            (i, key, p.logprobs)
            for i, (key, p) in enumerate(zip(self.rows.keys, self.rows.params, strict=True))
            if p.logprobs is not None
        ]
        return {key: token_logprobs(logits[i, kept[i].nonzero()[:, 0]], emitted[key], top) for i, key, top in asking}

    def _prefill(
        self, prompts: Sequence[Sequence[int]], tops: dict[int, int]
    ) -> tuple[RaggedBatch, torch.Tensor, dict[int, list[TokenLogprob]]]:
        """Run the target over the left-padded prompts, fill both caches; returns
        the new rows' batch state, their last logits [B, V], and for the prompts
        ``tops`` names, their tokens' log-probabilities with that many top tokens."""
        device = self.target.device
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        positions = torch.full((len(prompts), width), -1, dtype=torch.long, device=device)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, device=device)
            positions[i, width - len(prompt) :] = torch.arange(len(prompt), device=device)
        batch = self._new_batch(len(prompts))
        logits = self._prefill_forward(batch, ids, positions, every_position=bool(tops))
        scored = {
            i: token_logprobs(logits[i, width - len(prompts[i]) : width - 1], prompts[i][1:], top)
            for i, top in tops.items()
        }
        return batch, logits[:, -1], scored

    def _new_batch(self, rows: int) -> RaggedBatch:
        """Empty caches for ``rows`` rows about to be prefilled."""
        return RaggedBatch(
            slot_positions=torch.empty(rows, 0, dtype=torch.long, device=self.target.device),
            target_cache=self.target.new_cache(in_place=self.in_place_cache),
            draft_cache=self.target.new_cache(in_place=self.in_place_cache) if self.draft is not None else None,
        )

    def _prefill_forward(
        self, batch: RaggedBatch, ids: torch.Tensor, positions: torch.Tensor, *, every_position: bool = False
    ) -> torch.Tensor:
        """Append prompt tokens ``ids`` at ``positions`` [B, n] to ``batch``'s caches
        (the draft's context too); returns the last position's logits [B, 1, V]
        (prompts are left-padded), or with ``every_position`` every position's
        [B, n, V] (to score the prompt). Only the last by default: the LM head over
        every prompt position cost 13-19 % of a SmolLM2 prefill of 128-2,048 tokens
        (docs/LOG.md)."""
        out = self.target.forward(
            ids,
            positions,
            batch.target_cache,
            batch.slot_positions,
            feature_layers=self.feature_layers,
            logits_to_keep=0 if every_position else 1,
        )
        if self.draft is not None:
            self._append_context(batch, self.draft, out.features, positions)
        batch.commit(positions)
        return out.logits

    def _propose(
        self, positions: torch.Tensor, branching: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft b-1 tokens per row in one draft forward; returns the drafts [B, b-1],
        for sampled proposals their distributions q [B, b-1, V], and, when
        ``branching``, the alternates for the first drafted slot [B, m] (``_alternates``)."""
        anchors = self.rows.anchors
        none = anchors.new_empty(len(anchors), 0)
        if positions.shape[1] == 1:
            return none, None, none
        draft, batch = self.draft, self._batch()
        # Blocks over 1 need a draft (``step`` checks), whose rows have a draft cache.
        assert draft is not None and batch.draft_cache is not None
        block = torch.full_like(positions, draft.mask_token_id)
        block[:, 0] = anchors
        embeddings = self.target.embed(block) * draft.config.input_embedding_scale
        hidden = draft(embeddings, positions, draft_context(batch.draft_cache), batch.slot_positions)
        argmax = self.proposal == "argmax" or self.all_greedy
        if argmax and draft.draft_vocab_ids is not None and not self._adjusting():
            # Nothing adjusts these logits and no q is needed: choose among the draft
            # vocabulary's K columns, never scattering them into V (the scatter, topk and
            # argmax over 49k logits were a sixth of this method on SmolLM2; docs/LOG.md).
            reduced = draft.draft_logits(hidden[:, 1:], self.target, full_vocab=False)
            best = greedy_tokens(reduced)
            others = self._alternates(reduced[:, 0], best[:, 0]) if branching else none
            return draft.draft_vocab_ids[best], None, draft.draft_vocab_ids[others]
        # Slot 0 (the anchor) is discarded; slot j predicts the token at its own position.
        # Penalties use the committed history only, so every slot is still drafted in parallel.
        # A reduced draft vocabulary leaves -inf outside it: never an argmax, zero in q.
        logits = self._adjusted(draft.draft_logits(hidden[:, 1:], self.target))
        logits, constrained = self._constrained_chains(logits, argmax)
        # Greedy rows' q is the one-hot of the argmax (``probabilities``): an all-greedy round skips q.
        if argmax:
            drafts, q = greedy_tokens(logits), None
        else:
            q = probabilities(logits, self.rows.params)
            drafts = sample_positions(q, self.rows.generators)
        for i, chain in constrained.items():
            drafts[i] = torch.tensor(chain, device=drafts.device)
        return drafts, q, self._alternates(logits[:, 0], drafts[:, 0]) if branching else none

    def _grammar_matcher(self, grammar: Grammar) -> GrammarMatcher:
        if self.grammars is None:
            raise ValueError("a row with a grammar needs a session with a GrammarCompiler (grammars=...)")
        return self.grammars.matcher(grammar)

    def _constrained_chains(self, logits: torch.Tensor, argmax: bool) -> tuple[torch.Tensor, dict[int, list[int]]]:
        """The draft's logits [B, b-1, V] with each constrained row's chain chosen
        slot by slot under its grammar: slot j masked with the state after the
        chain's slots before it, then its token drawn (or its argmax) from the
        masked distribution, which is then that slot's q. Returns the masked
        logits and each constrained row's chain."""
        rows = self._constrained_rows()
        if not rows:
            return logits, {}
        logits = logits.clone()
        chains = {
            i: matcher.chain(functools.partial(self._choose_under, logits, i, argmax), logits.shape[1])
            for i, matcher in rows
        }
        return logits, chains

    def _choose_under(self, logits: torch.Tensor, row: int, argmax: bool, slot: int, allowed: torch.Tensor) -> int:
        """The draft's token for ``row``'s chain ``slot`` among the ``allowed`` ones;
        ``logits`` [B, b-1, V] keep the masked slot, whose distribution is then its q."""
        params = self.rows.params[row]
        masked = logits[row, slot].masked_fill(~allowed.to(logits.device), float("-inf"))
        if not bool(torch.isfinite(masked).any()):
            # Nothing the draft can propose is allowed (a reduced draft vocabulary):
            # propose the first allowed token, with all of q on it.
            masked = torch.full_like(masked, float("-inf"))
            masked[int(allowed.nonzero()[0])] = 0.0
        logits[row, slot] = masked
        if argmax or params.greedy:
            return int(greedy_tokens(masked))
        q = probabilities(masked[None, None], [params])[:, 0]
        return int(sample_rows(q, [self.rows.generators[row]])[0])

    def _grammar_masked(self, logits: torch.Tensor, block: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """Verify logits [B, n, V] with each constrained row's slots masked by its
        grammar after the tokens on the slot's own path (``GrammarMatcher.path_masks``).
        Only those rows are written, in place: a mask over the whole batch cost a
        batch of 8 with one constrained row 12 % a round. The forward's own logits
        are copied first where a constrained row reports log-probabilities, which
        stay the model's."""
        rows = self._constrained_rows()
        if not rows:
            return logits
        if any(self.rows.params[i].logprobs is not None for i, _ in rows):
            logits = logits.clone()
        for i, matcher in rows:
            tokens = block[i].tolist()
            paths = [[tokens[t] for t in path] for path in tree.paths]
            logits[i].masked_fill_(~matcher.path_masks(paths).to(logits.device), float("-inf"))
        return logits

    def _constrained_rows(self) -> list[tuple[int, GrammarMatcher]]:
        """The rows under a grammar, with their matchers."""
        return [(i, m) for i, m in enumerate(self.rows.grammars) if m is not None]

    def _adjusting(self) -> bool:
        """Whether some row adjusts its logits (``_adjusted``: logit bias, penalties, early-stop
        suppression; a grammar's masks, ``_constrained_chains`` and ``_grammar_masked``)."""
        rows = zip(self.rows.params, self.rows.generated, strict=True)
        return any(p.logit_bias or p.penalized or p.suppressing(n) or p.grammar for p, n in rows)

    def _alternates(self, first_logits: torch.Tensor, first_drafts: torch.Tensor) -> torch.Tensor:
        """The draft's next ``branches - 1`` most likely tokens for the first
        drafted slot after its draft ``first_drafts`` [B] (from ``first_logits``
        [B, V], or [B, K] over a draft vocabulary with drafts and alternates as
        its indices; a sampled draft need not be the argmax), verified beside the chain [B, m]."""
        others = first_logits.scatter(-1, first_drafts[:, None], float("-inf"))
        return others.topk(self.branches - 1, dim=-1).indices

    def _lookup(self, start: torch.Tensor, looking: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's n-gram lookup continuation [B, L] (``NgramIndex.propose``)
        and which of its slots the row filled [B, L]; L is the longest
        continuation found, 0 in a round not ``looking`` or without any match.
        Slots past the model's context never count. A row under a grammar that
        forces its next tokens (a key's name, a separator) proposes those instead."""
        found = [
            (grammar.forced(self.lookup) if grammar is not None else [])
            or (index.propose(self.lookup) if index else [])
            if looking
            else []
            for index, grammar in zip(self.rows.ngrams, self.rows.grammars, strict=True)
        ]
        width = max(map(len, found), default=0)
        if not width:
            return start.new_empty(len(found), 0), start.new_empty(len(found), 0, dtype=torch.bool)
        device = self.target.device
        tokens = torch.tensor([[*f, *[0] * (width - len(f))] for f in found], device=device)
        valid = torch.tensor([[j < len(f) for j in range(width)] for f in found], device=device)
        return tokens, valid & (start + 1 + torch.arange(width, device=device) < self.target.context_length)

    def _adjusted(
        self, logits: torch.Tensor, block: torch.Tensor | None = None, tree: DraftTree | None = None
    ) -> torch.Tensor:
        """The rows' logit bias, penalties and early stop suppression on block logits
        [B, n, V]: the same for the draft's q and the target's p, which exactness needs.
        With the verify ``block`` [B, n] and its ``tree``, each slot's distribution
        is adjusted for its own path (the tokens on it, its depth): the one plain
        decoding would use after that prefix, whichever path the row commits.
        Without them, every position as right after the committed tokens."""
        if not self._adjusting():
            return logits
        device = logits.device
        drafts = None if block is None else block[:, 1:]
        paths, depths = (None, None) if tree is None else (tree.visibility(device), tree.depths(device))
        return _adjust(logits, self.rows.params, self.rows.history, self.rows.generated, drafts, paths, depths)

    def _accept(
        self,
        block: torch.Tensor,
        tree: DraftTree,
        lookup_valid: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
    ) -> Verdict:
        params = self.rows.params
        # Each slot's distribution is adjusted as after its exact prefix: the anchor and its path.
        target_logits = self._grammar_masked(self._adjusted(target_logits, block, tree), block, tree)
        if tree.width > tree.chain:
            valid = torch.cat([lookup_valid.new_ones(len(block), tree.lookup_start), lookup_valid], dim=1)
            if self.all_greedy:
                return verify_greedy_tree(block, valid, tree, target_logits)
            target_probs = probabilities(target_logits, params)
            return verify_sampled_tree(block, valid, tree, draft_probs, target_probs, self.rows.generators)
        drafts = block[:, 1:]
        if self.all_greedy:
            return verify_greedy(drafts, target_logits)
        return verify_sampled(drafts, draft_probs, probabilities(target_logits, params), self.rows.generators)

    def _commit(
        self, kept: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None, block_size: int
    ) -> None:
        """Keep the ``kept`` slots [B, q] of the appended block (the anchor and the accepted path) in both caches."""
        batch = self._batch()
        batch.commit(torch.where(kept, positions, -1))
        if self.draft is None:
            return
        if block_size == 1:
            # A plain step's draft context waits for the next drafting round, which projects every
            # waiting token at once: the draft's weights are read once, not once per plain step (a
            # b = 1 step appending its own context cost 4.6-5.1 % more than one without a draft).
            assert features is not None  # with a draft, every target forward captures its feature layers
            self._deferred.append((features, positions))
        else:
            self._append_context(batch, self.draft, features, positions)

    @torch.inference_mode()
    def _flush_context(self) -> None:
        """Append the draft context of the plain steps since the last projection to the draft cache."""
        if not self._deferred:
            return
        features = torch.cat([f for f, _ in self._deferred], dim=1)
        positions = torch.cat([p for _, p in self._deferred], dim=1)
        self._deferred.clear()
        assert self.draft is not None  # only steps with a draft defer context
        self._append_context(self._batch(), self.draft, features, positions)

    def _batch(self) -> RaggedBatch:
        """The rows' batch state, which exists whenever the session has rows."""
        assert self.batch is not None, "the session has no rows"
        return self.batch

    @staticmethod
    def _append_context(
        batch: RaggedBatch, draft: DFlashDraftModel, features: torch.Tensor | None, positions: torch.Tensor
    ) -> None:
        """Append the draft's context K/V of a target forward's ``features`` to ``batch``'s draft cache."""
        # With a draft, every target forward captures its feature layers and the batch has a draft cache.
        assert features is not None and batch.draft_cache is not None
        append_draft_context(batch.draft_cache, draft.context_kv(features, positions))


def _adjust(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: TokenHistory,
    generated: Sequence[int],
    drafts: torch.Tensor | None = None,
    paths: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, n, V] as the rows sample from them: the logit bias, then the
    penalties (vLLM's order), then the early-stop suppression; ``drafts``,
    ``paths`` and ``depths`` place a verify block's slots (``penalize``,
    ``suppress_early``)."""
    logits = penalize(bias_logits(logits, params), params, history, drafts, paths)
    return suppress_early(logits, params, generated, depths)


def _copy_rows(batch: RaggedBatch, last_logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Make ``batch``'s prefilled rows the given ``rows`` of it (an index repeated
    for each copy of an identical prompt); returns their last logits [len(rows), V]."""
    if rows == list(range(len(last_logits))):
        return last_logits
    index = torch.tensor(rows, device=last_logits.device)
    batch.select_rows(index)
    return last_logits[index]


def _trimmed(scores: list[TokenLogprob], top: int) -> list[TokenLogprob]:
    """``scores`` with each token's ``top`` best only (a shared prefill computed the most any row asked for)."""
    return [TokenLogprob(s.token, s.logprob, s.top[:top]) for s in scores]


def _sample_first(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    if all(p.greedy for p in params):
        return greedy_tokens(logits)
    return sample_rows(probabilities(logits[:, None], params)[:, 0], generators)


def _round_stats(verdict: Verdict, tree: DraftTree, draft_seconds: float, verify_seconds: float) -> RoundStats:
    committed = verdict.num_accepted
    by_draft = committed if verdict.draft_accepted is None else verdict.draft_accepted
    branches_taken = 0
    if verdict.path_end is not None:
        branches_taken = int(tree.is_alternate(verdict.path_end).sum())
    accepted = by_draft.tolist()
    return RoundStats(
        batch_size=len(accepted),
        block_size=tree.chain,
        committed=[n + 1 for n in committed.tolist()],
        accepted_per_position=[sum(n > k for n in accepted) for k in range(tree.chain - 1)],
        verified_per_position=[len(accepted)] * (tree.chain - 1),
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        branches_taken=branches_taken,
        lookup_accepted=int((committed - by_draft).sum()),
    )


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
