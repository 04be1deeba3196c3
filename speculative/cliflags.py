"""Command-line flags made from a dataclass: one ``--flag`` per field, typed
and defaulted by the field, so a config is the single source of its flags
(``dflash-train``'s configs, ``dflash-controller``'s decision settings)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Collection, Mapping
from typing import Any

SCALARS = (int, float, str)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type[Any], skip: Collection[str] = frozenset()) -> None:
    """Add ``--field-name`` for every field of ``cls`` not in ``skip``: int,
    float and str fields take one value, ``tuple[X, ...]`` fields one or more,
    bool fields are ``--field-name`` / ``--no-field-name``.
    A field documented as ``name: text`` in the class docstring gets that text
    as its help."""
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        help_text = (
            docs[field.name].rstrip(".").replace("%", "%%") + " (default: %(default)s)" if field.name in docs else None
        )
        if hints[field.name] is bool:
            flag = f"--{field.name.replace('_', '-')}"
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
            continue
        kind, many = _flag_type(hints[field.name], field.name)
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            nargs="+" if many else None,
            default=field.default,
            help=help_text,
        )


def dataclass_kwargs(args: Mapping[str, Any], cls: type[Any], skip: Collection[str] = frozenset()) -> dict[str, Any]:
    """The parsed values of ``cls``'s flags, as keyword arguments for ``cls``
    (lists from multi-value flags become the tuples the fields hold)."""
    names = {f.name for f in dataclasses.fields(cls)} - set(skip)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if k in names}


def _flag_type(hint: Any, name: str) -> tuple[type, bool]:
    """(the type of one value, whether the flag takes several)."""
    if hint in SCALARS:
        return hint, False
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[0] in SCALARS and args[1] is Ellipsis:
        return args[0], True
    raise TypeError(f"field {name!r}: no command-line flag for type {hint!r}")


def _field_docs(cls: type[Any]) -> dict[str, str]:
    """``name: text`` entries of the class docstring (continuation lines indented deeper)."""
    docs: dict[str, str] = {}
    fields = {f.name for f in dataclasses.fields(cls)}
    name, indent = None, 0
    for line in (cls.__doc__ or "").splitlines():
        entry = re.match(r"^(\s*)(\w+): (.+)", line)
        if entry and entry[2] in fields:
            name, indent = entry[2], len(entry[1])
            docs[name] = entry[3].strip()
        elif name is not None and line.strip() and len(line) - len(line.lstrip()) > indent:
            docs[name] += " " + line.strip()
        else:
            name = None
    return docs
