"""Speculative generation of a fixed set of prompts with a DFlash draft.

``spec_generate`` prefills every prompt, then runs rounds of propose -> verify
-> accept -> commit (``speculative.session.DecodeSession.step``) until each row
meets a stop token or its length limit, dropping finished rows at once. Rows
accept different lengths in the same round; ``speculative.batch`` keeps the
ragged caches. ``b = 1`` is plain autoregressive decoding.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args

from speculative.context import ContextLengthExceeded, check_context
from speculative.draft import DFlashDraftModel
from speculative.grammar import GrammarCompiler
from speculative.sampling import GREEDY, SamplingParams
from speculative.session import DEFAULT_COMPACT_SLACK, DecodeSession, Proposal, RoundStats, check_pair
from speculative.target import TargetModel

__all__ = ["DecodeConfig", "GenerationResult", "RoundStats", "check_pair", "emit_tokens", "spec_generate"]

_Row = TypeVar("_Row", bound=Hashable)


@dataclass(frozen=True)
class DecodeConfig:
    """Settings of one ``spec_generate`` call.

    block_size: tokens per verify block, the anchor included (16 -> 15 drafts;
        1 -> plain decoding, no draft needed).
    max_new_tokens: generated tokens per prompt at most.
    stop_token_ids: a generated token from this set ends its row (it is kept).
    proposal: "sample" draws a sampled row's draft at each slot from the draft's
        distribution q, warped as the row's target distribution is (greedy rows
        take q's argmax); "argmax" drafts q's most likely token for every row (a
        point mass). At T = 1 on the default pair sampled proposals raised tau
        from 1.16 to 1.29 (HumanEval, b3; docs/LOG.md).
    compact_slack: compact the caches once this many slots per row are wasted.
    branches: candidates verified for the first drafted slot (the draft's most
        likely tokens; 1: the chain alone). Rounds of rows without penalties only.
    lookup: n-gram lookup tokens verified beside the draft (0: none;
        ``speculative.lookup``). Rounds of rows without penalties only.
    lookup_table: where a row's own text has no match, lookup continues from
        the draft's n-gram table when it ships one (``speculative.ngram_table``).
    """

    block_size: int = 16
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    proposal: Proposal = "sample"
    compact_slack: int = DEFAULT_COMPACT_SLACK
    branches: int = 1
    lookup: int = 0
    lookup_table: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.proposal not in get_args(Proposal):
            raise ValueError(f"proposal must be 'argmax' or 'sample', got {self.proposal!r}")
        if self.compact_slack < 0:
            raise ValueError(f"compact_slack must be >= 0, got {self.compact_slack}")
        if self.branches < 1 or self.lookup < 0:
            raise ValueError(f"branches must be >= 1 and lookup >= 0, got {self.branches} and {self.lookup}")


@dataclass
class GenerationResult:
    """Generated tokens per prompt (prompt excluded), why each row stopped
    ("stop" or "length"), and per-round statistics."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_seconds: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per row-round over the whole run (tau)."""
        total = sum(sum(r.committed) for r in self.rounds)
        count = sum(len(r.committed) for r in self.rounds)
        return total / count if count else 0.0


def spec_generate(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    grammars: GrammarCompiler | None = None,
) -> GenerationResult:
    """Generate continuations of ``prompts`` (token ids) with DFlash speculation.

    The output distribution is exactly the target's; with greedy sampling the
    tokens equal target-only greedy decoding. ``sampling`` is one setting for
    all rows or one per prompt; ``grammars`` compiles their grammars, if any
    (``speculative.grammar``).
    """
    params = _per_row_sampling(sampling, len(prompts))
    _check_inputs(target, draft, prompts, config)
    # Plain decoding needs no proposals and no draft context.
    session = DecodeSession(
        target,
        draft if config.block_size > 1 else None,
        proposal=config.proposal,
        compact_slack=config.compact_slack,
        branches=config.branches,
        lookup=config.lookup,
        lookup_table=config.lookup_table,
        grammars=grammars,
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    first = session.add(list(range(len(prompts))), prompts, params)
    finished: list[int] = emit_tokens(outputs, reasons, {row: [token] for row, token in first.items()}, config)
    result = GenerationResult(tokens=outputs, finish_reasons=reasons)
    while True:
        session.remove(finished)
        if not len(session):
            break
        stats, emitted = session.step(config.block_size)
        result.rounds.append(stats)
        finished = emit_tokens(outputs, reasons, emitted, config)
    result.prefill_seconds = session.prefill_seconds
    return result


def _per_row_sampling(sampling: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    if len(sampling) != n:
        raise ValueError(f"got {len(sampling)} sampling settings for {n} prompts")
    return list(sampling)


def _check_inputs(
    target: TargetModel, draft: DFlashDraftModel | None, prompts: Sequence[Sequence[int]], config: DecodeConfig
) -> None:
    if not prompts:
        raise ValueError("no prompts")
    if config.block_size > 1:
        if draft is None:
            raise ValueError(f"block_size {config.block_size} needs a draft model")
        if config.block_size > draft.block_size:
            raise ValueError(f"block_size {config.block_size} exceeds the draft's trained block {draft.block_size}")
    for i, prompt in enumerate(prompts):
        try:
            check_context(target.context_length, len(prompt), config.max_new_tokens, config.block_size)
        except ContextLengthExceeded as exc:
            raise ContextLengthExceeded(f"prompt {i}: {exc}") from exc


def emit_tokens(
    outputs: MutableMapping[_Row, list[int]] | list[list[int]],
    reasons: MutableMapping[_Row, str] | list[str],
    new: Mapping[Any, list[int]],
    config: DecodeConfig,
) -> list[_Row]:
    """Append each row's new tokens, cut at a stop token or the length limit;
    returns the rows that finished (``reasons[row]`` says "stop", else it stays
    as the caller set it). ``new``'s keys index ``outputs`` and ``reasons``: the
    session's row keys, which are list indices when those are lists (hence ``Any``)."""
    stop = set(config.stop_token_ids)
    finished: list[_Row] = []
    for row, tokens in new.items():
        kept, finish = cut_at_stop(tokens, config.max_new_tokens - len(outputs[row]), stop)
        outputs[row].extend(kept)
        if finish == "stop":
            reasons[row] = "stop"
        if finish is not None:
            finished.append(row)
    return finished


def cut_at_stop(tokens: list[int], room: int, stop_token_ids: Collection[int]) -> tuple[list[int], str | None]:
    """What a row keeps of a round's tokens: up to and including the first stop
    token ("stop"), else at most ``room`` tokens ("length" once they fill it)."""
    for i, token in enumerate(tokens[:room]):
        if token in stop_token_ids:
            return tokens[: i + 1], "stop"
    kept = tokens[:room]
    return kept, "length" if len(kept) == room else None
