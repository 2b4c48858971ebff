"""Exceptions raised in a user's code, said in one line.

teamrl calls code its users write: a task's methods, a ``dataset`` task's reward, individual reward and
feedback functions. An exception there would otherwise surface as a traceback through the CLI, the
trainer and the rollout, with no word of which item the code was given. Every such call is marked as
user code, with :func:`user_code` around it (or, for a task class, :func:`user_method` on the method,
which :class:`~teamrl.envs.base.Environment` applies to the methods a user's subclass defines); an
exception that escapes it becomes a :class:`UserCodeError`: the function, the item, the exception's
type and message, and the line of the user's file it was raised at. The original exception is its
``__cause__`` (``teamrl --verbose``, or ``TEAMRL_TRACEBACK=1``, prints the whole traceback).

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

#: Longest exception message a :class:`UserCodeError` quotes.
MAX_MESSAGE_CHARS = 200
#: Most item ids a :class:`UserCodeError` names (a batch call's).
MAX_ITEMS_NAMED = 8

_TEAMRL_DIR = str(Path(__file__).resolve().parent)
Function = TypeVar("Function", bound=Callable[..., Any])


class OneLineError(ValueError):
    """An error whose message already says in one line what went wrong and where (a user's function that raised,
    or returned what teamrl cannot use): :func:`user_code` lets it pass unchanged."""


class UserCodeError(OneLineError):
    """An exception raised in a user's code (``error``), while teamrl ran ``function`` on ``items``.

    A ValueError, so ``teamrl`` reports it as one line (``teamrl: error: ...``, exit 2) and training
    stops with the checkpoint it keeps and the command that resumes from it."""

    def __init__(self, function: str, items: Any, error: BaseException):
        self.function = function
        """The user's function, ``Class.method`` or ``module:function``."""
        self.error = error
        """The exception the user's code raised (also this one's ``__cause__``)."""
        self.location = user_location(error)
        """``file:line`` of the innermost frame of the traceback in the user's files, or None."""
        message = " ".join(str(error).split())
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS - 3] + "..."
        where = f" at {self.location}" if self.location else ""
        super().__init__(f"{function} raised {type(error).__name__}{': ' if message else ''}{message}{where}, "
                         f"on {describe_items(items)}")


@contextmanager
def user_code(function: str, items: Any = None) -> Iterator[None]:
    """Mark the calls in the ``with`` block as the user's ``function`` working on ``items`` (an item, a list
    of them, or of ``(item, ...)`` requests): an exception they raise leaves as a :class:`UserCodeError`.

    One already said in one line passes unchanged (:class:`OneLineError`): a UserCodeError of a call further in,
    and an :class:`~teamrl.envs.checks.EnvironmentOutputError` about what a user's function returned."""
    try:
        yield
    except Exception as err:
        if isinstance(err, OneLineError):
            raise
        raise UserCodeError(function, items, err) from err


def user_method(owner: str, method: Function) -> Function:
    """``method`` of the user's class ``owner`` with its calls marked as user code (:func:`user_code`); the
    item is the call's first argument (or its list of requests)."""

    @functools.wraps(method)
    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with user_code(f"{owner}.{method.__name__}", args[0] if args else None):
            return method(self, *args, **kwargs)

    return marked  # type: ignore[return-value]


def describe_items(items: Any) -> str:
    """How a message names what a function was given: ``item 'train-3'``, ``items ['a', 'b']``."""
    if isinstance(items, Mapping):
        return f"item {items.get('id')!r}" if items.get("id") is not None else "an item with no id"
    if isinstance(items, Sequence) and not isinstance(items, str):
        entries = [entry[0] if isinstance(entry, tuple) and entry else entry for entry in items]
        ids = [*dict.fromkeys(item.get("id") for item in entries if isinstance(item, Mapping) and "id" in item)]
        if len(ids) == 1:
            return f"item {ids[0]!r}"
        if ids:
            shown = ", ".join(map(repr, ids[:MAX_ITEMS_NAMED]))
            return f"items [{shown}{', ...' if len(ids) > MAX_ITEMS_NAMED else ''}]"
    return "its input"


def user_location(error: BaseException) -> str | None:
    """``file:line`` where ``error`` was raised in the user's code: the innermost frame of its traceback in a
    file that is neither teamrl's nor an installed library's (else the innermost outside teamrl). The file
    is named relative to the working directory when it lies below it."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not _within(frame.filename, _TEAMRL_DIR)]
    own = [frame for frame in frames if not _is_library(frame.filename)]
    if not (own or frames):
        return None
    frame = (own or frames)[-1]
    return f"{_shown(frame.filename)}:{frame.lineno}"


def raised_in_user_code(error: BaseException) -> bool:
    """Whether ``error`` is, or was raised because of, a :class:`UserCodeError` (training's ``TrainingStopped``)."""
    while error is not None:
        if isinstance(error, UserCodeError):
            return True
        error = error.__cause__
    return False


def missing_field(error: BaseException) -> KeyError | None:
    """The KeyError behind ``error`` (itself, or the one a task's code raised): an item without a field the task
    reads, which ``teamrl generate`` and ``teamrl serve`` say in their own terms; None for another error."""
    error = error.error if isinstance(error, UserCodeError) else error
    return error if isinstance(error, KeyError) else None


def traceback_wanted(verbose: bool = False) -> bool:
    """Whether a one-line error should come with its traceback: ``--verbose``, or ``TEAMRL_TRACEBACK`` set to
    anything but empty or 0."""
    return verbose or os.environ.get("TEAMRL_TRACEBACK", "") not in ("", "0")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where the standard library and installed packages live: frames there are not the user's."""
    dirs = set()
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars)
        dirs.update(paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib"))
    dirs.update(getattr(site, "getsitepackages", list)())
    return tuple(sorted(os.path.realpath(path) for path in dirs if path))


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>: no file of the user's
        return True
    path = os.path.realpath(filename)
    return any(_within(path, folder) for folder in _library_dirs())


def _within(path: str, folder: str) -> bool:
    path = os.path.realpath(path) if not path.startswith("<") else path
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _shown(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename
