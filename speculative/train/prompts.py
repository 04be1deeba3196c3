"""A diverse, decontaminated prompt set for regenerating DFlash draft training
data with a pretrained chat target (the target writes the responses; this
module only chooses the prompts).

Everything is built offline from what the machine already has: the Python
standard library's code and docstrings, the language reference (``pydoc_data``)
and templates crossed with word lists written for this project. Six families,
each a generator of prompt texts (see ``FAMILIES``); ``build_prompts`` mixes
them in the fixed ``SHARES``.

Decontamination rule: a prompt is dropped when it shares any 13-gram of
lowercased word tokens with a held-out benchmark prompt (HumanEval's prompts
and both turns of every MT-Bench question). Long spans, not single phrases, are
what make a draft model memorise a benchmark; 13 words is the span length
commonly used for this check, long enough that shared idioms ("return true if
the given number is") do not trigger it.
"""

from __future__ import annotations

import functools
import json
import platform
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass

from speculative.bench.datasets import MTBENCH_FILE, humaneval, package_file
from speculative.train.prompt_math import math_prompts
from speculative.train.prompt_stdlib import code_prompts, docs_prompts
from speculative.train.prompt_text import chat_prompts, coding_prompts, explanation_prompts, writing_prompts

NGRAM = 13
WORD = re.compile(r"\w+")


def code_family() -> Iterator[str]:
    """Requests about the standard library's functions, then everyday programming tasks."""
    yield from code_prompts()
    yield from coding_prompts()


FAMILIES: dict[str, Callable[[], Iterable[str]]] = {
    "code": code_family,
    "docs": docs_prompts,
    "math": math_prompts,
    "chat": chat_prompts,
    "writing": writing_prompts,
    "explanations": explanation_prompts,
}
"""Family name (each prompt's ``source``) -> generator of its candidate texts, in a fixed order."""

SHARES = {"code": 0.30, "docs": 0.10, "math": 0.20, "chat": 0.16, "writing": 0.11, "explanations": 0.13}
"""Each family's fraction of a built set. Code leads, as one of the two held-out
benchmarks is code (HumanEval); the shares roughly follow the pool sizes, so a
built set keeps them up to about 39,000 prompts (of about 43,000)."""


DECONTAMINATION = {
    "rule": f"drop a prompt sharing a {NGRAM}-gram of lowercased words with a benchmark prompt",
    "benchmarks": ["humaneval prompts", "mt-bench turns"],
}
"""The rule as provenance files state it."""


@dataclass(frozen=True)
class Prompt:
    """One user message and the family it came from."""

    text: str
    source: str


@dataclass(frozen=True)
class Pools:
    """Every family's clean candidates (distinct across families) and how many
    candidates decontamination dropped from each."""

    prompts: dict[str, tuple[Prompt, ...]]
    dropped: dict[str, int]


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The ``n``-grams of ``text``'s lowercased word tokens (runs of letters, digits
    and underscores: punctuation and layout never hide a shared span)."""
    words = WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def benchmark_texts() -> list[str]:
    """The held-out prompts: HumanEval's 164 problems (as served) and all MT-Bench turns."""
    lines = package_file(*MTBENCH_FILE).read_text().splitlines()
    turns = [turn for line in lines for turn in json.loads(line)["turns"]]
    return [prompt.text for prompt in humaneval()] + turns


@functools.cache
def benchmark_ngrams(n: int = NGRAM) -> frozenset[tuple[str, ...]]:
    """Every ``n``-gram of every held-out benchmark prompt."""
    return frozenset(gram for text in benchmark_texts() for gram in ngrams(text, n))


def decontaminate(prompts: Iterable[Prompt], banned: Set[tuple[str, ...]], n: int = NGRAM) -> tuple[list[Prompt], int]:
    """The prompts that share no ``n``-gram with ``banned``, and how many were dropped."""
    prompts = list(prompts)
    kept = [prompt for prompt in prompts if banned.isdisjoint(ngrams(prompt.text, n))]
    return kept, len(prompts) - len(kept)


@functools.cache
def prompt_pools() -> Pools:
    """All families' candidates, each text once (case and spacing ignored; a text
    already given by an earlier family is skipped), then decontaminated. Seed
    and limit do not enter: the pool, and so the dropped counts, are fixed."""
    seen: set[str] = set()
    banned = benchmark_ngrams()
    prompts, dropped = {}, {}
    for family, generate in FAMILIES.items():
        fresh = []
        for text in generate():
            key = " ".join(text.lower().split())
            if key not in seen:
                seen.add(key)
                fresh.append(Prompt(text, family))
        kept, dropped[family] = decontaminate(fresh, banned)
        prompts[family] = tuple(kept)
    return Pools(prompts, dropped)


def build_prompts(limit: int, seed: int) -> list[Prompt]:
    """``limit`` distinct, decontaminated prompts (0: all of them), the same for the same seed.

    Each family's pool is shuffled with ``seed``; then prompts are drawn one at a
    time from the family furthest below its share, so every prefix of the list
    keeps ``SHARES`` (a smaller limit is a prefix of a larger one). Once a family
    runs out, the others fill the rest in their shares' proportions."""
    pools = prompt_pools().prompts
    queues = {family: list(pools[family]) for family in SHARES}
    for family, queue in queues.items():
        random.Random(f"{seed}:{family}").shuffle(queue)
    available = sum(map(len, queues.values()))
    taken = dict.fromkeys(SHARES, 0)
    chosen = []
    for _ in range(min(limit, available) if limit else available):
        family = min((f for f in SHARES if taken[f] < len(queues[f])), key=lambda f: taken[f] / SHARES[f])
        chosen.append(queues[family][taken[family]])
        taken[family] += 1
    return chosen


def provenance(prompts: list[Prompt], seed: int) -> dict[str, object]:
    """What a prompt set is, for the data command's meta file: the seed, counts per
    family, the shares asked for, the pool sizes, what decontamination dropped,
    and the Python version (the stdlib families depend on it)."""
    pools = prompt_pools()
    counts = Counter(prompt.source for prompt in prompts)
    return {
        "seed": seed,
        "prompts": len(prompts),
        "per_source": {family: counts[family] for family in SHARES},
        "shares": SHARES,
        "available": {family: len(pools.prompts[family]) for family in SHARES},
        "decontamination": {
            **DECONTAMINATION,
            "dropped": sum(pools.dropped.values()),
            "dropped_per_source": pools.dropped,
        },
        "python": platform.python_version(),
    }
