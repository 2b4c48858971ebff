"""Command-line flags made from a settings dataclass, so that each setting's help is written once, beside it.

A settings class (``teamrl eval``'s :class:`~teamrl.evaluation.methods.EvalSettings`, ``teamrl compare``'s
:class:`~teamrl.evaluation.compare.CompareSettings`) declares each field with :func:`option`: its help, its
default, and, where the flag's text is not the field's value, how to read it (``"0,1,2"`` -> ``(0, 1, 2)``).
:func:`add_flags` gives a parser one ``--field-name`` per such field; :func:`from_flags` builds the settings from
the parsed arguments, reading each text there, so that a bad value is the settings' own one-line error rather than
argparse's. This module imports nothing heavy: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from typing import Any

_MISSING = dataclasses.MISSING


def option(help: str, default: Any = _MISSING, *, parse: Callable[[str], Any] | None = None,
           flag: str | None = None) -> Any:
    """A settings field with its command-line flag: ``help`` (argparse's ``%(default)s`` allowed), ``default``,
    ``parse`` (the flag's text -> the field's value; ``default`` is then that text, parsed when the field is left
    out) and ``flag`` (the option's name when it is not ``--field-name``). A ``Literal`` field's flag takes its
    values only."""
    metadata = {"help": help, "parse": parse, "flag": flag, "text": default if parse else None}
    if parse is not None and default is not _MISSING:
        return dataclasses.field(default_factory=lambda: parse(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flagged_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of settings class ``cls`` declared with :func:`option`."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per :func:`option` field of ``cls``: ``--field-name``, its type, default, values and help."""
    hints = typing.get_type_hints(cls)
    for f in flagged_fields(cls):
        name = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
        if hints[f.name] is not bool:
            kwargs["metavar"] = name.lstrip("-").replace("-", "_").upper()
        if f.metadata["text"] is not None:
            kwargs["default"] = f.metadata["text"]
        elif f.default is not _MISSING:
            kwargs["default"] = f.default
        hint = hints[f.name]
        if hint is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _flag_type(hint) if not f.metadata["parse"] else str
            if typing.get_origin(hint) is typing.Literal:
                kwargs["choices"] = typing.get_args(hint)
        parser.add_argument(name, **kwargs)


def from_flags(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` built from the parsed ``args`` (each :func:`option` field's flag, read with its ``parse``) and the
    fields ``given`` here (those that are not flags: positional arguments, values the command works out)."""
    values = dict(given)
    for f in flagged_fields(cls):
        value = getattr(args, f.name)
        values[f.name] = f.metadata["parse"](value) if f.metadata["parse"] and isinstance(value, str) else value
    return cls(**values)


def _flag_type(hint: Any) -> Callable[[str], Any]:
    """What argparse converts a flag's text with: the field's type (``X | None``: X's)."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    base = args[0] if args else hint
    return base if base in (int, float) else str
