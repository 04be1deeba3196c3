"""Structured output: a row's tokens kept within a grammar (a JSON schema, a
regular expression), exactly.

A grammar is one more adjustment of the row's logits, like a penalty: every
slot of a verified block is masked with the grammar's state after the tokens
on that slot's own path (``GrammarMatcher.path_masks``), so the target's
distribution at each slot is the one constrained plain decoding would use, and
verification stays lossless. The draft's chain is chosen under the same masks
(``GrammarMatcher.chain``): its proposals stay inside the grammar, and a
sampled row's q is the masked distribution it drew from.

Matching is llguidance's (``LLMatcher``): token masks over the whole
vocabulary, checked token by token and rolled back, so a block's paths are
masked without copying the matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerFast

from speculative.chat import stop_token_ids

if TYPE_CHECKING:  # a stub-only type
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_schema", "regex"]
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""JSON as ``json.dumps`` lays it out. With any whitespace allowed between tokens (llguidance's
default) a weak model can fill its whole budget with it: the test target wrote "{" and then
spaces until max_tokens. A schema may still ask for more (``"x-guidance"``)."""


@dataclass(frozen=True)
class Grammar:
    """What a row's output must match: ``source`` is a JSON schema (as JSON
    text) or a regular expression, by ``kind``. Engines hand the source to
    their own matcher (SGLang's ``json_schema`` / ``regex`` sampling params)."""

    kind: GrammarKind
    source: str

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Exactly one of ``options``, as written."""
        return cls("regex", "(" + "|".join(re.escape(option) for option in options) + ")")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Grammar:
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are written in it

    def compiled(self) -> str:
        """The llguidance grammar (raises ValueError on a source that is not JSON)."""
        if self.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT))
        return str(llguidance.LLMatcher.grammar_from_regex(self.source))


GrammarTokenizer = llguidance.LLTokenizer
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # a bitmask word's bits, lowest first


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> GrammarTokenizer:
    """llguidance's view of a transformers fast tokenizer: ``vocab_size`` mask
    columns (the model's, which may exceed the tokenizer's), ``eos_ids`` the
    tokens a finished grammar allows. About 0.3 s for SmolLM2: build it once."""
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler | None:
    """A ``GrammarCompiler`` for a transformers fast tokenizer, whose finished
    grammars allow its end-of-text tokens (``chat.stop_token_ids``); None for
    any other tokenizer (llguidance reads the fast tokenizer's vocabulary)."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    stops = stop_token_ids(tokenizer)
    return GrammarCompiler(lambda: grammar_tokenizer(tokenizer, vocab_size, stops), vocab_size)


class GrammarCompiler:
    """Grammars compiled for one tokenizer, each once: ``check`` (run it off the
    decoding thread: a large schema can take 100 ms or more to compile) keeps
    the compiled matcher, and ``matcher`` then starts a row from a copy of it.
    ``tokenizer`` is called once, on first use (``grammar_tokenizer``)."""

    def __init__(self, tokenizer: Callable[[], GrammarTokenizer], vocab_size: int, cache_size: int = 64) -> None:
        self._make_tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._tokenizer: GrammarTokenizer | None = None
        self._compiled: dict[Grammar, llguidance.LLMatcher] = {}
        self._lock = threading.Lock()

    def check(self, grammar: Grammar) -> str | None:
        """Why ``grammar`` cannot be matched (an invalid schema or regex), or None."""
        tokenizer = self._tokenizer_once()
        try:
            self._prototype(grammar, tokenizer)
        except ValueError as exc:
            return str(exc)
        return None

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the start of ``grammar`` (ValueError if it cannot be matched)."""
        return GrammarMatcher(self._prototype(grammar, self._tokenizer_once()).deep_copy(), self.vocab_size)

    def _tokenizer_once(self) -> GrammarTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _prototype(self, grammar: Grammar, tokenizer: GrammarTokenizer) -> llguidance.LLMatcher:
        with self._lock:
            known = self._compiled.get(grammar)
        if known is not None:
            return known
        compiled = grammar.compiled()
        error = llguidance.LLMatcher.validate_grammar(compiled, tokenizer)
        if error:
            raise ValueError(error)
        matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            if len(self._compiled) >= self.cache_size:
                self._compiled.pop(next(iter(self._compiled)))  # the oldest
            self._compiled[grammar] = matcher
        return matcher


class GrammarMatcher:
    """One row's position in its grammar: the tokens it has committed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size

    def mask(self) -> torch.Tensor:
        """The tokens allowed next [V] (bool). A state that allows none (after the
        end of text, which a row never commits past) allows every token, so a
        slot no path can reach never turns its logits all -inf."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((words[:, None] >> _BIT_SHIFTS) & 1).flatten()[: self.vocab_size].bool()
        return allowed if bool(allowed.any()) else torch.ones_like(allowed)

    def path_masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """For each path (the tokens after the committed ones up to a block slot),
        the tokens allowed after it [len(paths), V]. A path the grammar refuses
        part-way cannot be committed (its first refused token has target
        probability 0 where it was refused), so its slot allows every token."""
        masks = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for i, path in enumerate(paths):
            consumed = self._matcher.try_consume_tokens(list(path))
            try:
                if consumed == len(path) or self._only_ends(path[consumed:]):
                    masks[i] = self.mask()
            finally:
                self._matcher.rollback(consumed)
        return masks

    def _only_ends(self, tokens: Sequence[int]) -> bool:
        """Whether a finished grammar stays where it is through ``tokens``: ends of
        text, the one token it allows, which the matcher does not consume twice."""
        if not self._matcher.is_stopped():
            return False
        after_end = self.mask()
        return all(bool(after_end[token]) for token in tokens)

    def chain(self, choose: Callable[[int, torch.Tensor], int], length: int) -> list[int]:
        """``length`` tokens chosen one after another, ``choose(position, mask)``
        each given the tokens allowed after the ones before it; the matcher is
        left where it was. (Only an unreachable state's all-allowed mask lets a
        refused token through; the positions after it keep the state before it.)"""
        tokens: list[int] = []
        consumed = 0
        try:  # a round that raises is retried (``DecodeSession.step``): the row must still be where it was
            for position in range(length):
                tokens.append(choose(position, self.mask()))
                if consumed == position and self._matcher.try_consume_tokens(tokens[-1:]) == 1:
                    consumed += 1
        finally:
            self._matcher.rollback(consumed)
        return tokens

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (none where it leaves a
        choice). Proposed as a lookup path: the target, masked, must agree unless
        it tokenizes the forced text another way."""
        return list(self._matcher.compute_ff_tokens()[:limit])

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit a row's emitted tokens (each allowed where it was drawn; after
        the end of text nothing more is committed, so the rest are ignored)."""
        for token in tokens:
            if self._matcher.is_stopped() or not self._matcher.consume_token(token):
                return
