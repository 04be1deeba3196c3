"""Prompts from the Python standard library's own code and documentation
(PSF licence), read from the running interpreter: nothing is downloaded.

Two families. ``code``: write a documented function from its signature and
docstring, or explain, fix (a bug is planted by one small operator change) or
refactor the real source of a short function, documented or not. ``docs``:
questions about real modules, classes and functions (summarise, explain the
parameters, give an example) quoting their docstrings, and about the language
reference's topics (``pydoc_data``).

Skipped: the test suites and tools (idlelib, lib2to3, turtledemo), which
document tests rather than an API anyone asks about; the generated codec
tables (encodings) and reference text (pydoc_data, read as topics instead),
which are a fifth of the bytes to parse and no code; and distutils, removed
from Python 3.12.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo"}
    | {"encodings", "pydoc_data", "distutils"}
)
MAX_SOURCE_LINES = 30
MAX_SOURCE_CHARS = 1500
MAX_EXCERPT_CHARS = 700
MIN_SUMMARY_CHARS = 20
MAX_PER_PACKAGE = 300

PY = "```python\n{source}\n```"
WRITE = (
    "Write a Python function `{name}{signature}` that does the following: {summary}",
    "Implement this function in Python.\n\nSignature: def {name}{signature}\nDescription: {summary}",
    'I need a Python function with the signature `{name}{signature}`. Its docstring reads: "{summary}" '
    "Could you write it?",
    "Complete this Python function:\n{header}",
    "Write the body of this Python function:\n```python\n{header}\n```",
    "How would you implement `{name}{signature}` in Python? It should do this: {summary}",
)
EXPLAIN = (
    "Explain what this Python function does, step by step:\n" + PY,
    "What does the following function from Python's `{module}` module do?\n" + PY,
    "Walk me through this code and describe its inputs and outputs:\n" + PY,
    "I found this function in the `{module}` module of the standard library. How does it work?\n" + PY,
    "Describe in plain English what this function does and what it returns, if anything:\n" + PY,
    "Add comments to this function that explain each step:\n" + PY,
)
FIX = (
    "This Python function has a bug. Find it and fix it:\n" + PY,
    "Can you spot the mistake in this code?\n" + PY,
    "My tests fail for this function. Please find the bug and explain the fix:\n" + PY,
)
FIX_DOCUMENTED = "The function below doesn't do what its docstring says. What's wrong, and how do I fix it?\n" + PY
REFACTOR = (
    "Refactor this function to make it easier to read, and explain your changes:\n" + PY,
    "Add type hints to this function and improve its docstring:\n" + PY,
    "Rewrite this function in a more modern Python style:\n" + PY,
    "Write pytest unit tests for this function:\n" + PY,
    "What is the time complexity of this function? Explain briefly.\n" + PY,
    "Translate this Python function into JavaScript:\n" + PY,
    "How could the error handling in this function be improved?\n" + PY,
    "Can this function be simplified? Show a shorter version if so.\n" + PY,
)
# One small change that breaks a function; applied to a code line free of strings and comments.
MUTATIONS = (
    (" < ", " <= "),
    (" <= ", " < "),
    (" > ", " >= "),
    (" >= ", " > "),
    (" == ", " != "),
    (" != ", " == "),
    (" and ", " or "),
    (" or ", " and "),
    (" + 1", " - 1"),
    (" - 1", " + 1"),
    ("return True", "return False"),
    ("return False", "return True"),
    (" is None", " is not None"),
    (" is not None", " is None"),
    (" not in ", " in "),
)

MODULE_TASKS = (
    "Summarise what the Python module `{qualname}` is for, based on its documentation:\n\n{excerpt}",
    "Here is the documentation of Python's `{qualname}` module:\n\n{excerpt}\n\nExplain it in simpler words.",
    "What is the `{qualname}` module in Python's standard library used for? When would I reach for it?",
    "Give me a short example program that uses the `{qualname}` module.",
)
FUNCTION_TASKS = (
    "Summarise this documentation in one plain-English sentence:\n\n{qualname}{signature}\n{excerpt}",
    "Here is the docstring of `{qualname}`:\n\n{excerpt}\n\nExplain it in simpler words and show a short example.",
    'What does `{qualname}{signature}` do? Its docstring says: "{summary}"',
    "Give an example of how to use `{qualname}`.",
    "In what situations would I use `{qualname}`?",
    "Explain the parameters of `{qualname}{signature}` and what each one means.",
    "Write a short tutorial section about `{qualname}`, with one example.",
    "What is `{qualname}` for, and what mistakes do people make when using it?",
)
CLASS_TASKS = (
    "Summarise this class documentation in two sentences:\n\n{qualname}{signature}\n{excerpt}",
    "Here is the docstring of the `{qualname}` class:\n\n{excerpt}\n\nWhat would I use it for? Show a small example.",
    "What is the `{qualname}` class for, and how do I create one?",
    "Give an example of using the `{qualname}` class from Python's standard library.",
)
TOPIC_TASKS = (
    "Explain {title} in Python, with a short example.",
    "What should a beginner know about {title} in Python?",
    "What are the most common mistakes Python programmers make with {title}?",
    "Write a short quiz (three questions with answers) about {title} in Python.",
    "Summarise what the Python reference manual says about {title}, in a few bullet points.",
)


@dataclass(frozen=True)
class Definition:
    """A module, class or function of the standard library.

    ``source`` (functions only) is the dedented definition, empty when it is too
    long to quote; ``doc_line`` and ``code_line`` are the indices of its lines where
    the docstring and the code after it begin (equal when it has no docstring)."""

    module: str
    name: str
    kind: str
    signature: str
    docstring: str
    source: str = ""
    doc_line: int = 0
    code_line: int = 0

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module

    @property
    def summary(self) -> str:
        """The docstring's first paragraph on one line."""
        return " ".join(self.docstring.split("\n\n")[0].split())

    @property
    def excerpt(self) -> str:
        """The leading paragraphs of the docstring that fit in ``MAX_EXCERPT_CHARS`` (empty if none does)."""
        kept: list[str] = []
        for paragraph in self.docstring.split("\n\n"):
            if len("\n\n".join([*kept, paragraph])) > MAX_EXCERPT_CHARS:
                break
            kept.append(paragraph)
        return "\n\n".join(kept)

    @property
    def documented(self) -> bool:
        return len(self.summary) >= MIN_SUMMARY_CHARS

    @property
    def code_lines(self) -> int:
        return len(self.source.splitlines()) - self.code_line

    @property
    def public(self) -> bool:
        return not any(part.startswith("_") for part in self.qualname.split("."))

    @property
    def header(self) -> str:
        """The def line(s) and docstring, without the body."""
        return "\n".join(self.source.splitlines()[: self.code_line])

    @property
    def bare(self) -> str:
        """The source without its docstring: explaining code should not be reading its summary aloud."""
        lines = self.source.splitlines()
        return "\n".join(lines[: self.doc_line]) + "\n" + "\n".join(lines[self.code_line :]).lstrip("\n")


def stdlib_files(root: Path | None = None) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every standard library source file, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("config-"))
        for file in sorted(f for f in files if f.endswith(".py")):
            parts = (Path(directory) / file).relative_to(root).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), Path(directory) / file


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool = False) -> str:
    args = node.args
    if drop_self and args.args:
        args = ast.arguments(**{**args.__dict__, "args": args.args[1:]})
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"({ast.unparse(args)}){returns}"


def _function(module: str, name: str, node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> Definition:
    """A function or method (``name`` has a dot; its signature drops ``self``), quoting
    its source when it is short and has code after the docstring."""
    docstring, signature = ast.get_docstring(node) or "", _signature(node, drop_self="." in name)
    end, first = node.end_lineno, node.body[0]
    assert end is not None and first.end_lineno is not None  # ast.parse records where every node ends
    if len(node.body) > bool(docstring) and end - node.lineno < MAX_SOURCE_LINES:
        text = textwrap.dedent("\n".join(lines[node.lineno - 1 : end]))
        if len(text) <= MAX_SOURCE_CHARS and not text[0].isspace():
            doc_line = first.lineno - node.lineno
            code_line = first.end_lineno - node.lineno + 1 if docstring else doc_line
            return Definition(module, name, "function", signature, docstring, text, doc_line, code_line)
    return Definition(module, name, "function", signature, docstring)


def file_definitions(module: str, source: str) -> list[Definition]:
    """The module, top-level functions, classes and methods of one file: those
    documented, and the functions short enough to quote."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = [Definition(module, "", "module", "", ast.get_docstring(tree) or "")]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(_function(module, node.name, node, lines))
        elif isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            signature = _signature(init, drop_self=True) if init else "()"
            found.append(Definition(module, node.name, "class", signature, ast.get_docstring(node) or ""))
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append(_function(module, f"{node.name}.{child.name}", child, lines))
    return [d for d in found if d.documented or d.source]


@functools.cache
def stdlib_definitions() -> tuple[Definition, ...]:
    """Every definition of the standard library that ``file_definitions`` keeps, in file order."""
    found: list[Definition] = []
    for module, path in stdlib_files():
        try:
            found.extend(file_definitions(module, path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return tuple(found)


def plant_bug(definition: Definition, rng: random.Random) -> str:
    """The function's source with one operator changed on one code line after the
    docstring (lines with strings or comments are left alone, so the change is
    always real code); empty when no line offers a change."""
    lines = definition.source.splitlines()
    choices = [
        (i, old, new)
        for i in range(definition.code_line, len(lines))
        if not any(c in lines[i] for c in "#'\"")
        for old, new in MUTATIONS
        if old in lines[i]
    ]
    if not choices:
        return ""
    i, old, new = rng.choice(choices)
    lines[i] = lines[i].replace(old, new, 1)
    return "\n".join(lines)


def spread(definitions: list[Definition], cap: int, rng: random.Random) -> list[Definition]:
    """At most ``cap`` definitions per top-level package (a random choice), in their
    original order: tkinter alone would otherwise be an eighth of the code family."""
    packages: dict[str, list[int]] = {}
    for i, d in enumerate(definitions):
        packages.setdefault(d.module.split(".")[0], []).append(i)
    keep = sorted(i for found in packages.values() for i in rng.sample(found, min(cap, len(found))))
    return [definitions[i] for i in keep]


def code_prompts(seed: int = 0) -> Iterator[str]:
    """Per short function: a request to write it (public, top-level, documented ones),
    then, if it has two lines of code or more, two of explain (with or without its
    docstring), fix a planted bug, refactor."""
    rng = random.Random(seed)
    functions = [d for d in stdlib_definitions() if d.kind == "function" and d.source]
    for d in spread(functions, MAX_PER_PACKAGE, rng):
        fields = dict(name=d.name, signature=d.signature, summary=d.summary, module=d.module, header=d.header)
        if d.public and d.documented and "." not in d.name:
            yield rng.choice(WRITE).format(**fields)
        if d.code_lines < 2:
            continue
        for task in rng.sample(("explain", "fix", "refactor"), 2):
            buggy = plant_bug(d, rng) if task == "fix" else ""
            if buggy:
                yield rng.choice((*FIX, FIX_DOCUMENTED) if d.documented else FIX).format(source=buggy)
            elif task == "refactor":
                yield rng.choice(REFACTOR).format(source=d.source)
            else:
                source = d.source if rng.random() < 0.5 else d.bare
                yield rng.choice(EXPLAIN).format(source=source, module=d.module)


def docs_prompts(seed: int = 0) -> Iterator[str]:
    """One question per public documented module, class and function (one quoting
    the docstring only when an excerpt fits), then the reference manual's topics."""
    rng = random.Random(seed)
    tasks = {"module": MODULE_TASKS, "class": CLASS_TASKS, "function": FUNCTION_TASKS}
    documented = [d for d in stdlib_definitions() if d.public and d.documented]
    for d in spread(documented, MAX_PER_PACKAGE, rng):
        usable = [t for t in tasks[d.kind] if d.excerpt or "{excerpt}" not in t]
        usable = [t for t in usable if d.signature != "()" or "parameters" not in t]
        fields = dict(qualname=d.qualname, signature=d.signature, summary=d.summary, excerpt=d.excerpt)
        yield rng.choice(usable).format(**fields)
    for title in sorted({text.splitlines()[0].strip() for text in topics.values()}):
        yield from (t.format(title=title.lower().replace('"', "`")) for t in TOPIC_TASKS)


def reference_paragraphs(min_words: int = 25) -> list[str]:
    """Prose paragraphs of the language reference (``pydoc_data``), for writing tasks
    such as summaries; grammar rules and code (indented blocks) are left out."""
    return [
        " ".join(paragraph.split())
        for key in sorted(topics)
        for paragraph in topics[key].split("\n\n")
        if len(paragraph.split()) >= min_words and not paragraph.startswith(" ")
    ]
