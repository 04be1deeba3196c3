"""The prompt set for regenerating draft training data: size, determinism,
shares, and decontamination against the held-out benchmarks."""

import json
import re
from collections import Counter

import pytest

from speculative.bench.datasets import MTBENCH_FILE, humaneval, mtbench, package_file
from speculative.train import prompts
from speculative.train.prompts import (
    SHARES,
    WORD,
    Prompt,
    benchmark_ngrams,
    build_prompts,
    decontaminate,
    ngrams,
    provenance,
)


@pytest.fixture(scope="module")
def everything() -> list[Prompt]:
    return build_prompts(0, seed=0)


def test_all_prompts_are_many_distinct_attributed_and_filled_in(everything):
    texts = [p.text for p in everything]
    assert len(texts) >= 20_000
    assert len(set(texts)) == len(texts)
    assert {p.source for p in everything} == set(SHARES)
    templated = [p.text for p in everything if p.source in ("math", "chat", "explanations")]
    assert not [text for text in templated if re.search(r"[{}]", text)]


def test_build_is_deterministic_deduplicated_and_keeps_the_shares():
    first = build_prompts(4000, seed=1)
    assert first == build_prompts(4000, seed=1)
    assert first != build_prompts(4000, seed=2)
    assert len({p.text for p in first}) == 4000
    counts = Counter(p.source for p in first)
    assert sum(SHARES.values()) == pytest.approx(1.0)
    for family, share in SHARES.items():
        assert counts[family] / 4000 == pytest.approx(share, abs=0.005)
    assert build_prompts(500, seed=1) == first[:500]


def test_ngrams_are_lowercased_word_tokens():
    assert ngrams("Hello, World! hello_there 42", n=2) == {
        ("hello", "world"),
        ("world", "hello_there"),
        ("hello_there", "42"),
    }
    assert ngrams("too short", n=3) == set()


def test_decontamination_drops_benchmark_spans_and_keeps_shorter_overlaps():
    words = WORD.findall(humaneval()[0].text)
    start = words.index("Check")  # the docstring: "Check if in given list of numbers, are any two ..."
    wrap = "Zebra quartz, please help: {} (zebra quartz)"
    turns = [json.loads(line)["turns"] for line in package_file(*MTBENCH_FILE).read_text().splitlines()]
    second_turn = next(t[1] for t in turns if len(t[1].split()) > 20)
    candidates = [
        Prompt(wrap.format(" ".join(words[start : start + 13])), "test"),
        Prompt("Could you answer this for me? " + mtbench()[3].text, "test"),
        Prompt("Follow-up question: " + second_turn, "test"),
        Prompt(wrap.format(" ".join(words[start : start + 12])), "test"),
        Prompt(wrap.format(" ".join(words[start + 1 : start + 13])), "test"),
        Prompt("What is the capital of France?", "test"),
    ]
    kept, dropped = decontaminate(candidates, benchmark_ngrams())
    assert dropped == 3
    assert kept == candidates[3:]


def test_pools_deduplicate_across_families_then_decontaminate(monkeypatch):
    leaked = "Fix the bug in this function:\n" + humaneval()[7].text
    families = {
        "code": lambda: [leaked, "Write hello world in Go."],
        "chat": lambda: ["write  hello world in go.", "Hi!"],  # the same text, spaced and cased differently
    }
    monkeypatch.setattr(prompts, "FAMILIES", families)
    pools = prompts.prompt_pools.__wrapped__()
    assert pools.dropped == {"code": 1, "chat": 0}
    assert pools.prompts == {"code": (Prompt("Write hello world in Go.", "code"),), "chat": (Prompt("Hi!", "chat"),)}


def test_no_built_prompt_shares_a_13_gram_with_a_benchmark(everything):
    assert decontaminate(everything, benchmark_ngrams())[1] == 0


def test_provenance_describes_a_built_set(everything):
    meta = provenance(everything[:1000], seed=0)
    assert (meta["seed"], meta["prompts"], sum(meta["per_source"].values())) == (0, 1000, 1000)
    assert meta["per_source"] == dict(Counter(p.source for p in build_prompts(1000, seed=0)))
    cleaning = meta["decontamination"]
    assert cleaning["dropped"] == sum(cleaning["dropped_per_source"].values())
    assert sum(meta["available"].values()) == len(everything)
    json.dumps(meta)
