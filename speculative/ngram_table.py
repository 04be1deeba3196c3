"""A corpus n-gram table: what the target most often writes after a short context.

Prompt lookup (``speculative.lookup``) copies from the request's own text, so it
finds nothing in most rounds of a chat answer. A small target, though, repeats
itself across answers ("Here are some tips to help you ...", "```python\\ndef"):
REST (He et al. 2024) retrieves continuations from a datastore of such text.
This table is the compact form of that datastore: for every context of
``sizes`` tokens seen in the target's own regenerated answers, the next token
it wrote there most often, kept only where that token followed the context at
least ``min_count`` times (one-off text is not kept, and the table stays a few
MB). A continuation is read greedily with back-off to shorter contexts, one
token at a time, so it reads like the target's most frequent phrasing.

Filling the lookup path from the table in rounds where the request's own text
has no match raised greedy tau at b3 from 2.89 to 3.20 on HumanEval and from
1.90 to 2.22 on MT-Bench with the default draft (``dflash-bench``, docs/LOG.md).
The table only proposes: verification keeps the output the target's.

It ships beside a draft as ``ngram_table.safetensors`` (``dflash-train
ngram-table``); a context of n tokens is packed into one uint64 key, 16 bits a
token, so targets with up to 65,536 tokens and n <= 4 are supported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

TABLE_NAME = "ngram_table.safetensors"
DEFAULT_SIZES = (4, 3, 2)
"""Context lengths, longest first. On stage 8's outputs (4, 3, 2) did as well as
(6, 5, 4, 3, 2) at half the size; dropping the bigrams cost a quarter of MT-Bench's gain."""
DEFAULT_MIN_COUNT = 2
"""How often the kept next token must have followed its context. 2 halves the
table against 1 for 0.03 of the MT-Bench gain; 3 costs another 0.03."""
MIN_SHARE = 0.2
"""A proposal stops where the product of its tokens' shares would fall below
this. Each verify slot costs ~2 % of a plain step on 2 CPU cores; simulated on
stage 8's outputs, 0.2 kept 77-91 % of the table's tau gain with about 2 fewer
slots a round, the best throughput of 0-0.5 on MT-Bench (docs/LOG.md)."""
TOKEN_BITS = 16
MAX_CONTEXT = 64 // TOKEN_BITS


def _pack(windows: np.ndarray) -> np.ndarray:
    """[m, n] token ids -> [m] uint64 keys, the first token in the highest bits."""
    keys = np.zeros(len(windows), dtype=np.uint64)
    for column in windows.T:
        keys = (keys << np.uint64(TOKEN_BITS)) | column.astype(np.uint64)
    return keys


@dataclass(frozen=True)
class NgramTable:
    """Per context length n: sorted context keys, the next token kept for each,
    and how often it followed (uint8 share of the context's occurrences, in 255ths)."""

    keys: Mapping[int, np.ndarray]
    next_tokens: Mapping[int, np.ndarray]
    shares: Mapping[int, np.ndarray]
    vocab_size: int
    about: Mapping[str, object]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Context lengths, longest first (the back-off order)."""
        return tuple(sorted(self.keys, reverse=True))

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys.values())

    @classmethod
    def build(
        cls,
        sequences: Iterable[Sequence[int]],
        *,
        vocab_size: int,
        sizes: Sequence[int] = DEFAULT_SIZES,
        min_count: int = DEFAULT_MIN_COUNT,
        about: Mapping[str, object] | None = None,
    ) -> NgramTable:
        """Count, over ``sequences`` (the target's answers, never crossing from one
        into the next), which token follows every context of each size."""
        if not 0 < vocab_size <= 1 << TOKEN_BITS:
            raise ValueError(f"an n-gram table packs tokens into {TOKEN_BITS} bits: vocab_size {vocab_size} is too big")
        if not sizes or min(sizes) < 1 or max(sizes) > MAX_CONTEXT or min_count < 1:
            raise ValueError(f"sizes must lie in [1, {MAX_CONTEXT}] and min_count be >= 1, got {sizes}, {min_count}")
        parts: list[np.ndarray] = []
        for sequence in sequences:
            parts += [np.asarray(sequence, dtype=np.int64), np.array([-1])]  # -1 separates answers
        flat = np.concatenate(parts) if parts else np.array([], dtype=np.int64)
        if len(flat) and int(flat.max()) >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        keys, next_tokens, shares = {}, {}, {}
        for n in sorted(set(sizes), reverse=True):
            keys[n], next_tokens[n], shares[n] = _most_frequent_next(flat, n, min_count)
        made = {"sizes": sorted(set(sizes), reverse=True), "min_count": min_count, **(about or {})}
        return cls(keys, next_tokens, shares, vocab_size, made)

    def next_token(self, context: Sequence[int]) -> tuple[int, float] | None:
        """The kept next token after the longest suffix of ``context`` the table
        has, and the share of that suffix's occurrences it followed; None if none."""
        for n in self.sizes:
            if len(context) < n:
                continue
            key = 0
            for token in context[-n:]:
                key = (key << TOKEN_BITS) | token
            keys = self.keys[n]
            at = int(np.searchsorted(keys, np.uint64(key)))
            if at < len(keys) and int(keys[at]) == key:
                return int(self.next_tokens[n][at]), int(self.shares[n][at]) / 255
        return None

    def propose(self, tokens: Sequence[int], max_tokens: int, min_share: float = MIN_SHARE) -> list[int]:
        """Up to ``max_tokens`` tokens continuing ``tokens``, each the table's next
        token after what comes before it (the proposal so far included), while
        the product of their shares stays at least ``min_share``: a verify slot
        costs time, so a path stops where the corpus stops agreeing with itself."""
        context, share = list(tokens[-MAX_CONTEXT:]), 1.0
        out: list[int] = []
        while len(out) < max_tokens:
            found = self.next_token(context)
            if found is None or share * found[1] < min_share:
                break
            token, share = found[0], share * found[1]
            out.append(token)
            context = [*context[1:], token] if len(context) == MAX_CONTEXT else [*context, token]
        return out

    def save(self, path: str | Path) -> None:
        tensors = {}
        for n in self.sizes:
            tensors[f"keys.{n}"] = self.keys[n]
            tensors[f"next.{n}"] = self.next_tokens[n]
            tensors[f"shares.{n}"] = self.shares[n]
        metadata = {"vocab_size": str(self.vocab_size), "about": json.dumps(dict(self.about), sort_keys=True)}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> NgramTable:
        try:
            with safe_open(str(path), framework="np") as f:
                metadata = f.metadata() or {}
            tensors = load_file(str(path))
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a safetensors file: {exc}") from exc
        sizes = [n for n in range(MAX_CONTEXT, 0, -1) if f"keys.{n}" in tensors]
        expected = {f"{kind}.{n}" for n in sizes for kind in ("keys", "next", "shares")}
        if not sizes or set(tensors) != expected or "vocab_size" not in metadata:
            raise ValueError(f"{path} is not an n-gram table (keys.N, next.N and shares.N per size, vocab_size)")
        keys = {n: tensors[f"keys.{n}"] for n in sizes}
        next_tokens = {n: tensors[f"next.{n}"].astype(np.int64) for n in sizes}
        shares = {n: tensors[f"shares.{n}"] for n in sizes}
        return cls(keys, next_tokens, shares, int(metadata["vocab_size"]), json.loads(metadata.get("about", "{}")))


def _most_frequent_next(flat: np.ndarray, n: int, min_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted uint64 keys of the contexts of ``n`` tokens in ``flat``, for each
    the token that followed most often (the lowest id on a tie), where it did at
    least ``min_count`` times, and the share of the context's occurrences it
    followed (uint8, in 255ths)."""
    empty = np.array([], dtype=np.uint64), np.array([], dtype=np.uint16), np.array([], dtype=np.uint8)
    if len(flat) <= n:
        return empty
    windows = np.lib.stride_tricks.sliding_window_view(flat, n + 1)
    windows = windows[windows.min(axis=1) >= 0]  # context and next token inside one answer
    if not len(windows):
        return empty
    context, following = _pack(windows[:, :n]), windows[:, n]
    order = np.lexsort((following, context))
    context, following = context[order], following[order]
    starts = np.flatnonzero(np.r_[True, (context[1:] != context[:-1]) | (following[1:] != following[:-1])])
    counts = np.diff(np.r_[starts, len(context)])
    context, following = context[starts], following[starts]
    group = np.cumsum(np.r_[True, context[1:] != context[:-1]]) - 1
    totals = np.bincount(group, weights=counts)[group]  # the context's occurrences, per (context, next) pair
    best = np.lexsort((following, -counts, context))  # per context: the most frequent first
    context, following, counts, totals = context[best], following[best], counts[best], totals[best]
    first = np.r_[True, context[1:] != context[:-1]]
    kept = first & (counts >= min_count)
    shares = np.rint(255 * counts[kept] / totals[kept]).astype(np.uint8)
    return context[kept], following[kept].astype(np.uint16), shares
