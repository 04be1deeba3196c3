"""Prompts the target writes itself: seeded openings in their shares, cleaning
rules, the chat template's user header, and a real run with the tiny target
whose provenance accounts for every request asked."""

from collections import Counter

import pytest
from transformers import AutoTokenizer

from speculative.train import prompt_writer
from speculative.train.cli import main, read_prompts
from speculative.train.prompt_writer import (
    OPENINGS,
    SHARES,
    clean_written,
    keep_written,
    user_turn_prefix,
    writer_openings,
)
from speculative.train.prompts import Prompt, ngrams


def test_openings_keep_the_shares_and_the_seed_fixes_them():
    chosen = writer_openings(900, seed=3)
    counts = Counter(category for category, _ in chosen)
    assert all(abs(counts[c] - 900 * share) <= 2 for c, share in SHARES.items())
    assert all(opening in OPENINGS[category] for category, opening in chosen)
    assert writer_openings(900, seed=3) == chosen and writer_openings(900, seed=4) != chosen
    assert writer_openings(90, seed=3) == chosen[:90]  # a smaller set is a prefix of a larger one


def test_cleaning_drops_unfinished_fragments_and_rambles():
    assert clean_written("Write a", " poem about the sea.\n", "stop") == ("Write a poem about the sea.", "kept")
    assert clean_written("", "Why is the sky blue at noon?", "length") == (None, "unfinished")
    assert clean_written("Solve", " it", "stop") == (None, "too short")
    assert clean_written("", " word" * 301, "stop") == (None, "too long")


def test_the_user_header_is_the_template_up_to_the_message(tiny_pipeline):
    root, _, _ = tiny_pipeline
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    prefix = user_turn_prefix(tokenizer)
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert whole.startswith(prefix + "hello there") and prefix.endswith("user\n")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        user_turn_prefix(tokenizer)


def test_the_target_writes_prompts_and_every_request_is_accounted_for(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    flags = ["--written-by", str(root / "target"), "--limit", "24", "--seed", "2", "--max-new-tokens", "40"]
    main(["prompts", "--out", str(tmp_path / "a.jsonl"), *flags])
    written, made = read_prompts(tmp_path / "a.jsonl")
    assert made is not None and made["asked"] == 24 and made["prompts"] == len(written) > 0
    assert len(written) + sum(made["dropped"].values()) == 24
    for prompt in written:
        category = prompt.source.removeprefix("written:")
        assert category in OPENINGS and prompt.text.startswith(tuple(OPENINGS[category]))
        assert len(prompt.text.split()) >= prompt_writer.MIN_WORDS

    main(["prompts", "--out", str(tmp_path / "b.jsonl"), *flags])
    assert read_prompts(tmp_path / "b.jsonl") == (written, made)  # the same seed writes the same prompts
    assert made["writer"]["temperature"] == 0.9 and made["openings"] == {k: list(v) for k, v in OPENINGS.items()}


def test_only_distinct_finished_clean_prompts_are_kept():
    benchmark_like = "Imagine you are a detective in a small town and the baker has vanished at dawn today"
    written = [
        ("open", "", "How do I keep basil alive indoors?", "stop"),
        ("open", "", "how do I keep  basil alive indoors?", "stop"),  # the same text again
        ("writing", "Write a", " haiku about rain and the old harbour wall", "stop"),
        ("roleplay", "Imagine you are", benchmark_like.removeprefix("Imagine you are"), "stop"),
        ("math", "Solve", " x + 1 = 2 and then", "length"),
        ("math", "Solve", " it", "stop"),
    ]
    kept, dropped = keep_written(written, frozenset(ngrams(benchmark_like + " and more words")))
    assert kept == [
        Prompt("How do I keep basil alive indoors?", "written:open"),
        Prompt("Write a haiku about rain and the old harbour wall", "written:writing"),
    ]
    assert dropped == {"repeat": 1, "benchmark overlap": 1, "unfinished": 1, "too short": 1}


def test_written_prompts_need_a_limit(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    with pytest.raises(SystemExit):
        main(["prompts", "--written-by", str(root / "target"), "--out", str(tmp_path / "p.jsonl")])
