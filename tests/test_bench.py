"""dflash-bench end to end on the tiny pipeline pair."""

import json

import pytest
import torch

from speculative.bench import run
from speculative.bench.cli import main
from speculative.bench.datasets import humaneval, mtbench
from speculative.bench.diagnose import target_confidence
from speculative.bench.run import distinct_ngram_ratio, interleave
from speculative.checkpoint import save_draft
from speculative.sampling import SamplingParams


def test_datasets_come_from_the_installed_packages():
    problems, questions = humaneval(), mtbench()
    assert len(problems) == 164 and len(questions) == 80
    assert problems[0].id == "HumanEval/0" and "def has_close_elements" in problems[0].text
    assert len(humaneval(limit=3)) == 3


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([[1, 2, 3, 4, 5]]) == 1.0
    assert distinct_ngram_ratio([[7] * 10]) == pytest.approx(1 / 7)
    assert distinct_ngram_ratio([[1, 2]]) == 1.0


def test_methods_take_turns_unit_by_unit_and_each_is_charged_its_own_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock[0])
    calls: list[tuple[str, int]] = []
    cost = {"a": 1.0, "b": 10.0, "c": 100.0}

    def method(name):
        def call(unit):
            calls.append((name, unit))
            clock[0] += cost[name] * (unit + 1)  # the machine slows down as the run goes on

        return call

    seconds = interleave({name: method(name) for name in cost}, 4)
    # Every unit runs under every method before the next unit starts; the first method rotates.
    assert [name for name, _ in calls] == list("abcbcacababc")
    assert [unit for _, unit in calls] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert seconds == {name: c * (1 + 2 + 3 + 4) for name, c in cost.items()}


def test_bench_prints_table_and_json(model, tmp_path, capsys):
    root, _, draft, _ = model
    save_draft(draft, tmp_path / "draft")
    main(
        [
            "--target",
            str(root / "target"),
            "--draft",
            str(tmp_path / "draft"),
            "--assistant",
            str(root / "target"),
            "--limit",
            "2",
            "--block-sizes",
            "2",
            "4",
            "--branches",
            "1",
            "3",
            "--lookup",
            "0",
            "4",
            "--temperatures",
            "0",
            "1",
            "--max-new-tokens",
            "12",
            "--diagnose",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    rows = summary["rows"]
    methods = {r["method"] for r in rows}
    dflash = {f"dflash b{b}{k}{n}" for b in (2, 4) for k in ("", " k3") for n in ("", " L4")}
    assert methods == {"target-only", *dflash, "hf generate", "hf prompt-lookup", "hf assisted"}
    assert {r["dataset"] for r in rows} == {"humaneval", "mtbench"}
    greedy_dflash = [r for r in rows if r["method"].startswith("dflash") and r["temperature"] == 0]
    assert greedy_dflash and all(r["lossless"] for r in greedy_dflash)
    # Sampled rows verify alternates too (recursive rejection sampling); without branches none is taken.
    sampled = [r for r in rows if r["method"].startswith("dflash") and r["temperature"] > 0]
    assert all(r["branch_share"] == 0 for r in sampled if r["branches"] == 1)
    assert any(r["branch_share"] > 0 for r in sampled if r["branches"] > 1)
    assert any(r["lookup_tokens_per_round"] > 0 for r in greedy_dflash if r["lookup"])
    assert all(len(r["acceptance_per_position"]) == r["block_size"] - 1 for r in greedy_dflash)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert lines[0].startswith("dtype float32 (asked for); CPU features:")  # figures carry the machine beside them
    assert summary["machine"]["dtype"] == "float32" and isinstance(summary["machine"]["cpu_features"], list)
    assert lines[1] == f"linears: {summary['machine']['linears']}" and "packed" in lines[1]
    assert lines[2].split()[:2] == ["dataset", "method"]
    # --diagnose: one line and one JSON entry per dataset; the draft's block (4) was benchmarked.
    assert sorted(summary["diagnosis"]) == ["humaneval", "mtbench"]
    for name, diagnosis in summary["diagnosis"].items():
        assert 0 < diagnosis["target_top1_mean"] <= 1 and 0 <= diagnosis["target_top1_below_half"] <= 1
        assert len(diagnosis["teacher_forced_accuracy"]) == 3  # slots 1-3 of a b4 draft
        assert 1 <= diagnosis["simulated_tau"] <= 4 and 0 <= diagnosis["simulated_slot1_acceptance"] <= 1
        b4 = next(r for r in rows if r["dataset"] == name and r["method"] == "dflash b4" and r["temperature"] == 0)
        assert diagnosis["measured_tau"] == b4["tau"]
        assert any(line.startswith(name) and "simulated tau" in line for line in lines)


def test_target_confidence_is_the_top1_probability_decoding_used(model):
    _, target, _, _ = model
    prompt, output = [5, 6, 7, 8], [9, 9, 9, 10, 9]
    tokens = torch.tensor([prompt + output])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        logits = target.forward(tokens, positions, target.new_cache(), positions[:, :0]).logits[0, 3:-1]
    plain = target_confidence(target, prompt, output, SamplingParams())
    torch.testing.assert_close(plain, logits.float().softmax(-1).amax(-1))
    # With a repetition penalty, position j penalises the prompt and output[:j], as decoding did.
    penalised = target_confidence(target, prompt, output, SamplingParams(repetition_penalty=2.0))
    for j in range(len(output)):
        row = logits[j].float().clone()
        seen = torch.tensor(sorted(set(prompt + output[:j])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 2.0, row[seen] * 2.0)
        torch.testing.assert_close(penalised[j], row.softmax(-1).max())


def test_demo_runs_a_local_pair_through_the_chat_template(model, tmp_path, capsys):
    from speculative.demo import main as demo

    root, _, draft, _ = model
    save_draft(draft, tmp_path / "draft")
    demo(
        [
            "--target",
            str(root / "target"),
            "--draft",
            str(tmp_path / "draft"),
            "--block-sizes",
            "2",
            "4",
            "--max-new-tokens",
            "8",
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["block_size"] for r in summary["prompts"]["results"]] == [2, 4]
    assert all(r["lossless"] for r in summary["prompts"]["results"])

    # Without --block-sizes: the draft's reach, whatever its trained block.
    demo(["--target", str(root / "target"), "--draft", str(tmp_path / "draft"), "--max-new-tokens", "4"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = [b for b in (2, 3, 4, 8, 16) if b <= draft.block_size]
    assert [r["block_size"] for r in summary["prompts"]["results"]] == expected
