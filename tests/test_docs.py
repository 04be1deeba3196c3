"""The docs name only code that exists: every backticked identifier and path in
README.md and docs/ (the experiment log aside: it is history and names what
was) is found in the repository's code, so a rename cannot leave a page behind."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
HISTORY = {ROOT / "docs" / "LOG.md"}
CODE_DIRS = ("speculative", "service", "bench", "dashboards", "deploy", "tests")
CODE_FILES = ("Makefile", "Dockerfile", "docker-compose.yml", "pyproject.toml")

SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?")
PATH = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+/?")
ENV_PREFIX = "DFLASH_"
"""Settings read from the environment are the fields' names upper-cased behind this prefix (pydantic-settings)."""
EXTERNAL = frozenset(
    {"mem_fraction_static", "spec_accept_rate", "spec_accept_length", "apply_dflash_verify_logits_adjustments"}
)
"""SGLang's own names, which docs/sglang.md explains the plugin against (SGLang is not installed here)."""


def looks_like_code(name: str) -> bool:
    """snake_case, dotted, CamelCase or called: what only code would spell so
    (plain words such as `stream` or `usage` are API fields as often as prose)."""
    bare = name.removesuffix("()")
    return "_" in bare or "." in bare or name.endswith("()") or re.search(r"[a-z][A-Z]", bare) is not None


@cache
def code_words() -> frozenset[str]:
    """Every identifier-like word in the repository's code and build files."""
    texts = [
        path.read_text(errors="replace")
        for folder in CODE_DIRS
        for path in (ROOT / folder).rglob("*")
        if path.is_file()
        and path.suffix in {".py", ".json", ".yaml", ".yml", ".sh", ".toml", ".j2"}
        and path != Path(__file__).resolve()
    ]
    texts += [(ROOT / name).read_text() for name in CODE_FILES]
    return frozenset(word for text in texts for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def missing_names(page: Path) -> list[str]:
    """Backticked identifiers and repository paths on ``page`` that the code lacks."""
    missing = []
    for span in SPAN.findall(page.read_text()):
        if PATH.fullmatch(span) and span.split("/")[0] in {*CODE_DIRS, "docs", "models", ".ci"}:
            if not (ROOT / span.rstrip("/")).exists() and not list(ROOT.glob(span.rstrip("/"))):
                missing.append(span)
        elif DOTTED.fullmatch(span) and looks_like_code(span):
            # Of a dotted name the last part is what the code defines (the rest are modules or owners).
            name = span.removesuffix("()").split(".")[-1]
            setting = name.removeprefix(ENV_PREFIX).lower() if name.startswith(ENV_PREFIX) else name
            if not {name, setting} & code_words() and name not in EXTERNAL:
                missing.append(span)
    return missing


@pytest.mark.parametrize("page", [p for p in PAGES if p not in HISTORY], ids=lambda p: p.name)
def test_every_backticked_code_name_exists(page: Path) -> None:
    assert missing_names(page) == []


def test_a_renamed_function_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("The rule lives in `_no_such_helper_anywhere()`; `decide` and `service/api/app.py` exist.")
    assert missing_names(page) == ["_no_such_helper_anywhere()"]
    page.write_text("See `speculative/no_such_module.py`.")
    assert missing_names(page) == ["speculative/no_such_module.py"]
