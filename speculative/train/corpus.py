"""The offline training corpus: the Python standard library's own sources
(PSF licence), read from the running interpreter's installation.

Two views of it: whole files (language-model pretraining text) and chat pairs
made from documented functions (user: signature and docstring, assistant: the
whole function), so the target also learns the chat format it is served with.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """Source files in a fixed order, with a fingerprint for provenance."""

    root: Path
    files: tuple[Path, ...]

    @classmethod
    def stdlib(cls, root: Path | None = None) -> Corpus:
        """Every ``.py`` file of the standard library (tests included), sorted."""
        root = Path(root or sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if not EXCLUDED_PARTS.intersection(p.relative_to(root).parts))
        if not files:
            raise FileNotFoundError(f"no Python sources under {root}")
        return cls(root=root, files=tuple(files))

    def texts(self) -> Iterator[str]:
        """File contents (undecodable files are skipped: a handful of test fixtures)."""
        for path in self.files:
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue

    def fingerprint(self) -> str:
        """SHA-256 over relative paths and contents: which corpus a model saw."""
        digest = hashlib.sha256()
        for path in self.files:
            digest.update(str(path.relative_to(self.root)).encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()


@dataclass(frozen=True)
class ChatPair:
    """One instruction: complete a documented function."""

    prompt: str
    response: str


def function_pairs(source: str, *, min_body_lines: int = 3, max_chars: int = 3000) -> list[ChatPair]:
    """Chat pairs from the documented functions of one source file: the prompt is
    the signature and docstring, the response the complete function (dedented)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        docstring = ast.get_docstring(node)
        end, body_end = node.end_lineno, node.body[0].end_lineno
        assert end is not None and body_end is not None  # ast.parse records where every node ends
        if not docstring or len(node.body) < 2 or end - node.lineno < min_body_lines:
            continue
        function = textwrap.dedent("\n".join(lines[node.lineno - 1 : end]))
        if len(function) > max_chars:
            continue
        header = "\n".join(function.splitlines()[: body_end - node.lineno + 1])
        pairs.append(ChatPair(prompt="Complete this Python function:\n" + header, response=function))
    return pairs


def request_prompts(source: str, *, min_chars: int = 20, max_chars: int = 600) -> list[str]:
    """Plain-English requests made from the docstrings of one source file: the
    first paragraph of the module's and of each documented class's and
    function's docstring, asked for as code with no signature given. They are
    prompts only (the target writes the responses), closer in form to natural
    language questions than the function-completion prompts."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    prompts = []
    for node in nodes:
        docstring = ast.get_docstring(node)
        summary = " ".join(docstring.split("\n\n")[0].split()) if docstring else ""
        if min_chars <= len(summary) <= max_chars:
            prompts.append("Write Python code for this: " + summary)
    return prompts
