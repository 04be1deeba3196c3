"""The corpus n-gram table: counting, back-off proposals, files, and the lookup that falls back to it."""

import json

import numpy as np
import pytest
from builders import tiny_draft

from speculative.checkpoint import CheckpointError, load_draft, save_draft
from speculative.lookup import NgramIndex
from speculative.ngram_table import TABLE_NAME, NgramTable
from speculative.train.cli import main as train_main

ANSWERS = [
    [5, 6, 7, 8, 9],
    [5, 6, 7, 8, 2],
    [5, 6, 7, 8, 2],
    [1, 6, 7, 3],
    [1, 6, 7, 3],
    [4, 4, 4],
]


def test_the_table_keeps_the_most_frequent_next_token_seen_often_enough():
    table = NgramTable.build(ANSWERS, vocab_size=10, sizes=(3, 2), min_count=2)
    assert table.sizes == (3, 2)
    assert table.next_token([5, 6, 7]) == (8, 1.0)  # three times of three
    assert table.next_token([6, 7, 8]) == (2, 170 / 255)  # 2 twice against 9 once: a share of 2/3
    assert table.next_token([1, 6, 7]) == (3, 1.0)
    # (6, 7) is followed by 8 three times and by 3 twice: the longer context decides where it exists.
    assert table.next_token([0, 6, 7]) == (8, 153 / 255)
    assert table.next_token([4, 4]) is None  # (4, 4) -> 4 once only
    assert table.next_token([8, 9]) is None  # 9 ends its answer: nothing followed it
    assert table.next_token([7]) is None  # no unigram contexts
    ties = NgramTable.build([[1, 2, 9], [1, 2, 9], [1, 2, 3], [1, 2, 3]], vocab_size=10, sizes=(2,), min_count=1)
    assert ties.next_token([1, 2]) == (3, 128 / 255)  # a tie goes to the lowest id


def test_contexts_never_span_two_answers():
    table = NgramTable.build([[1, 2], [3, 4], [1, 2], [3, 4]], vocab_size=5, sizes=(2,), min_count=1)
    assert table.next_token([1, 2]) is None  # 3 starts the next answer, it does not follow (1, 2)
    assert len(table) == 0


def test_a_proposal_follows_the_table_greedily_with_back_off():
    table = NgramTable.build(ANSWERS, vocab_size=10, sizes=(3, 2), min_count=2)
    assert table.propose([0, 5, 6], 8) == [7, 8, 2]
    assert table.propose([0, 5, 6], 2) == [7, 8]
    # 7 and 8 always followed their contexts; 2 followed (6, 7, 8) two times in three.
    assert table.propose([0, 5, 6], 8, min_share=0.7) == [7, 8]
    assert table.propose([0, 5, 6], 8, min_share=0.6) == [7, 8, 2]
    assert table.propose([0, 9], 4) == []
    assert table.propose([5, 6], 0) == []


def test_the_table_round_trips_through_its_file(tmp_path):
    table = NgramTable.build(ANSWERS, vocab_size=10, sizes=(3, 2), min_count=2, about={"source": "unit test"})
    table.save(tmp_path / TABLE_NAME)
    loaded = NgramTable.load(tmp_path / TABLE_NAME)
    assert (loaded.sizes, loaded.vocab_size, len(loaded)) == (table.sizes, 10, len(table))
    assert loaded.about == {"source": "unit test", "sizes": [3, 2], "min_count": 2}
    for n in table.sizes:
        assert np.array_equal(loaded.keys[n], table.keys[n])
        assert np.array_equal(loaded.next_tokens[n], table.next_tokens[n])
        assert np.array_equal(loaded.shares[n], table.shares[n])
    (tmp_path / "junk").write_bytes(b"not a table")
    with pytest.raises(ValueError, match="not a safetensors file"):
        NgramTable.load(tmp_path / "junk")


def test_the_table_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match="16 bits"):
        NgramTable.build(ANSWERS, vocab_size=70000)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        NgramTable.build(ANSWERS, vocab_size=8)
    with pytest.raises(ValueError, match="sizes"):
        NgramTable.build(ANSWERS, vocab_size=10, sizes=(5,))


def test_lookup_falls_back_to_the_table_only_without_a_match_of_its_own():
    table = NgramTable.build(ANSWERS, vocab_size=10, sizes=(3, 2), min_count=2)
    own = NgramIndex([5, 6, 1, 1, 5, 6], table)
    assert own.propose(4) == [1, 1, 5, 6]  # the row's own (5, 6) -> 1 beats the table's 7
    fallback = NgramIndex([0, 5, 6], table)
    assert fallback.propose(4) == [7, 8, 2]
    assert NgramIndex([0, 5, 6]).propose(4) == []


def test_load_draft_reads_the_table_beside_the_weights(tmp_path):
    draft = tiny_draft()
    save_draft(draft, tmp_path)
    assert load_draft(tmp_path).ngram_table is None
    vocab = int(draft.config.architecture.vocab_size)
    NgramTable.build(ANSWERS, vocab_size=vocab, min_count=1).save(tmp_path / TABLE_NAME)
    assert load_draft(tmp_path).ngram_table.propose([0, 5, 6], 2) == [7, 8]
    NgramTable.build(ANSWERS, vocab_size=vocab - 1).save(tmp_path / TABLE_NAME)
    with pytest.raises(CheckpointError, match=f"vocabulary of {vocab - 1}, not {vocab}"):
        load_draft(tmp_path)
    (tmp_path / TABLE_NAME).write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="n-gram table"):
        load_draft(tmp_path)


def test_the_cli_counts_regenerated_answers_into_the_draft(tmp_path, capsys):
    save_draft(tiny_draft(), tmp_path / "draft")
    data = tmp_path / "data.jsonl"
    records = [{"id": i, "prompt_ids": [3, 3], "response_ids": answer} for i, answer in enumerate(ANSWERS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    train_main(["ngram-table", "--data", str(data), "--draft", str(tmp_path / "draft"), "--sizes", "3", "2"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["responses"] == len(ANSWERS) and summary["response_tokens"] == sum(map(len, ANSWERS))
    assert summary["sources"][0]["file"] == "data.jsonl" and summary["min_count"] == 2
    table = load_draft(tmp_path / "draft").ngram_table
    # Prompt tokens are not counted: (3, 3) -> 5 would otherwise be kept.
    assert table.propose([0, 5, 6], 8) == [7, 8, 2] and table.next_token([3, 3]) is None
