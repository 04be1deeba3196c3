"""The per-row state a decoding session keeps beside its caches, in batch order."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from speculative.grammar import GrammarMatcher
from speculative.lookup import NgramIndex
from speculative.penalties import TokenHistory
from speculative.sampling import SamplingParams


@dataclass
class Rows:
    """Per-row state in batch order: caller's key, current anchor, sampling,
    the token history the repetition penalties read, the n-gram index
    lookup proposes from (None where the session does not look up), and the
    grammar matcher of a row with structured output (else None), and the
    tokens each row's caches hold (its prompt and what it emitted before its
    anchor: what a preempted row prefills again, ``DecodeSession.preempt``)."""

    keys: list[Hashable]
    anchors: torch.Tensor
    params: list[SamplingParams]
    generators: list[torch.Generator]
    history: TokenHistory
    generated: list[int]  # tokens each row has emitted (what min_tokens counts)
    ngrams: list[NgramIndex | None]
    grammars: list[GrammarMatcher | None]
    cached: list[list[int]]

    def select(self, index: list[int]) -> None:
        rows = torch.tensor(index, dtype=torch.long, device=self.anchors.device)
        self.keys = [self.keys[i] for i in index]
        self.anchors = self.anchors[rows]
        self.params = [self.params[i] for i in index]
        self.generators = [self.generators[i] for i in index]
        self.generated = [self.generated[i] for i in index]
        self.ngrams = [self.ngrams[i] for i in index]
        self.grammars = [self.grammars[i] for i in index]
        self.cached = [self.cached[i] for i in index]
        self.history.select(rows)

    def subset(self, index: list[int]) -> Rows:
        """These rows' state as a new ``Rows`` (generators shared, not copied)."""
        rows = torch.tensor(index, dtype=torch.long, device=self.anchors.device)
        history = copy.copy(self.history)
        history.select(rows)  # select assigns new tensors: the original keeps its own
        keys = [self.keys[i] for i in index]
        params = [self.params[i] for i in index]
        generators = [self.generators[i] for i in index]
        generated = [self.generated[i] for i in index]
        ngrams = [self.ngrams[i] for i in index]
        grammars = [self.grammars[i] for i in index]
        cached = [list(self.cached[i]) for i in index]
        return Rows(keys, self.anchors[rows], params, generators, history, generated, ngrams, grammars, cached)

    def extend(self, other: Rows) -> None:
        self.keys += other.keys
        self.anchors = torch.cat([self.anchors, other.anchors])
        self.params += other.params
        self.generators += other.generators
        self.generated += other.generated
        self.ngrams += other.ngrams
        self.grammars += other.grammars
        self.cached += other.cached
        self.history.extend(other.history)
