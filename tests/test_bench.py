"""dflash-bench end to end on the tiny pipeline pair."""

import json

import pytest

from speculative.bench.cli import main
from speculative.bench.datasets import humaneval, mtbench
from speculative.bench.run import distinct_ngram_ratio
from speculative.checkpoint import save_draft


def test_datasets_come_from_the_installed_packages():
    problems, questions = humaneval(), mtbench()
    assert len(problems) == 164 and len(questions) == 80
    assert problems[0].id == "HumanEval/0" and "def has_close_elements" in problems[0].text
    assert len(humaneval(limit=3)) == 3


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([[1, 2, 3, 4, 5]]) == 1.0
    assert distinct_ngram_ratio([[7] * 10]) == pytest.approx(1 / 7)
    assert distinct_ngram_ratio([[1, 2]]) == 1.0


def test_bench_prints_table_and_json(model, tmp_path, capsys):
    root, _, draft, _ = model
    save_draft(draft, tmp_path / "draft")
    main(
        [
            "--target", str(root / "target"), "--draft", str(tmp_path / "draft"), "--assistant", str(root / "target"),
            "--limit", "2", "--block-sizes", "2", "4", "--temperatures", "0", "1", "--max-new-tokens", "12",
        ]
    )  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    rows = summary["rows"]
    methods = {r["method"] for r in rows}
    assert methods == {"target-only", "dflash b2", "dflash b4", "hf generate", "hf prompt-lookup", "hf assisted"}
    assert {r["dataset"] for r in rows} == {"humaneval", "mtbench"}
    greedy_dflash = [r for r in rows if r["method"].startswith("dflash") and r["temperature"] == 0]
    assert greedy_dflash and all(r["lossless"] for r in greedy_dflash)
    assert all(len(r["acceptance_per_position"]) == r["block_size"] - 1 for r in greedy_dflash)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert lines[0].split()[:2] == ["dataset", "method"]


def test_demo_runs_a_local_pair_through_the_chat_template(model, tmp_path, capsys):
    from speculative.demo import main as demo

    root, _, draft, _ = model
    save_draft(draft, tmp_path / "draft")
    demo(["--target", str(root / "target"), "--draft", str(tmp_path / "draft"), "--block-sizes", "2", "4",
          "--max-new-tokens", "8"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["block_size"] for r in summary["prompts"]["results"]] == [2, 4]
    assert all(r["lossless"] for r in summary["prompts"]["results"])
