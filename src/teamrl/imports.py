"""Users' code by name: ``module:attribute`` import paths and entry points of installed packages.

Wherever a config takes the name of something a user writes (an environment, a reward function, a
feedback function), it also takes an import path ``module:attribute`` (``my_tasks:FactQA``,
``rewards.qa:score``). The module is imported as Python would, then, when that fails, from the folder
of the config file being run and from the working directory: ``teamrl train my.yaml`` finds a
``my_tasks.py`` next to ``my.yaml`` or in the current folder, which a console script's ``sys.path``
does not hold. An installed package may instead publish names in an entry-point group
(:data:`ENVIRONMENT_GROUP`), so that a bare name (``env.name: fact_qa``) finds it.

Every failure is one :class:`ImportPathError` (a ``ValueError``) naming the config field, the path and
where it looked.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

ENVIRONMENT_GROUP = "teamrl.environments"
"""Entry-point group of environments: ``[project.entry-points."teamrl.environments"] fact_qa =
"my_package.tasks:FactQA"`` makes ``env.name: fact_qa`` build ``FactQA``."""

_search_folders: list[Path] = []


class ImportPathError(ValueError):
    """An import path does not lead to an object; the message names the field and where it looked."""


def add_search_folder(folder: str | os.PathLike) -> None:
    """Also import users' modules from ``folder`` (the folder of a config file being run)."""
    folder = Path(folder).resolve()
    if folder not in _search_folders:
        _search_folders.append(folder)


def search_folders() -> list[Path]:
    """Where a module that Python cannot import is looked for: config files' folders, then the working
    directory."""
    return [*_search_folders, Path.cwd()]


def is_import_path(name: str) -> bool:
    """Whether ``name`` is a ``module:attribute`` import path rather than a registered name."""
    module, sep, attribute = name.partition(":")
    return bool(sep and module and attribute)


def load_object(path: str, field: str) -> Any:
    """The object the import path ``module:attribute`` names (``attribute`` may be dotted: ``Class.method``).

    Raises:
        ImportPathError: ``path`` is not ``module:attribute``, the module cannot be found or fails to
            import (its error is named), or it has no such attribute.
    """
    if not is_import_path(path):
        raise ImportPathError(f"{field}: {path!r} is not an import path; write module:name, e.g. my_rewards:score")
    module_name, _, attribute = path.partition(":")
    module = import_module(module_name, field)
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            names = [name for name in dir(value) if not name.startswith("_")]
            raise ImportPathError(f"{field}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                                  f"{attribute!r}{_did_you_mean(part, names)}")
        value = getattr(value, part)
    return value


def entry_point(group: str, name: str) -> Any | None:
    """The object an installed package publishes as ``name`` in entry-point ``group``, or None."""
    for point in importlib.metadata.entry_points(group=group):
        if point.name == name:
            return point.load()
    return None


def entry_point_names(group: str) -> list[str]:
    """The names installed packages publish in entry-point ``group``."""
    return sorted(point.name for point in importlib.metadata.entry_points(group=group))


def import_path_of(obj: Any) -> str | None:
    """``module:QualifiedName`` of a class or function that a fresh process can import back, else None
    (defined in ``__main__``, in a function, or not found under that name)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<locals>" in qualname:
        return None
    try:
        found = load_object(f"{module}:{qualname}", "import path")
    except ImportPathError:
        return None
    return f"{module}:{qualname}" if found is obj else None


def module_folder(obj: Any) -> str | None:
    """The folder from which ``obj``'s top-level package (or module) imports, so that another process
    (``teamrl generate`` elsewhere) can import it again; None for built-in and teamrl's own modules."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if module is None or file is None or module.__name__.split(".")[0] == "teamrl":
        return None
    path = Path(file).resolve()
    depth = module.__name__.count(".") + (path.stem == "__init__")
    return str(path.parents[depth])


def import_module(module_name: str, field: str) -> Any:
    """Import the module ``module_name``, as Python would or else from :func:`search_folders` (the config files'
    folders, the working directory), as :func:`load_object` imports a path's module.

    Raises:
        ImportPathError: it cannot be found, or raised while importing; the message names ``field``.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if not _is_missing(err, module_name):
            raise ImportPathError(f"{field}: importing {module_name!r} failed: {err}") from None
    except Exception as err:  # the user's module raised while importing: say so in one line
        raise ImportPathError(f"{field}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    for folder in search_folders():
        if _module_file(folder, module_name) is not None:
            if str(folder) not in sys.path:
                # Kept on the path: the module's own imports, and unpickling its objects, need it later.
                sys.path.append(str(folder))
            importlib.invalidate_caches()
            try:
                return importlib.import_module(module_name)
            except Exception as err:  # the user's module raised while importing: say so in one line
                raise ImportPathError(f"{field}: importing {module_name!r} from {folder} failed: "
                                      f"{type(err).__name__}: {err}") from None
    where = ", ".join(str(folder) for folder in search_folders())
    nearby = [path.stem for folder in search_folders() if folder.is_dir() for path in folder.glob("*.py")]
    raise ImportPathError(f"{field}: no module named {module_name!r} (looked in the installed packages and in "
                          f"{where}); put {module_name.replace('.', '/')}.py in the config file's folder or the "
                          f"working directory, or install it{_did_you_mean(module_name, nearby)}")


def _did_you_mean(name: str, candidates: list[str]) -> str:
    """``"; did you mean 'x'?"`` naming the candidate closest to a misspelt ``name``, or nothing."""
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _is_missing(err: ModuleNotFoundError, module_name: str) -> bool:
    """Whether ``err`` says ``module_name`` itself (or a package above it) is missing, not something it imports."""
    return err.name is not None and (module_name == err.name or module_name.startswith(err.name + "."))


def _module_file(folder: Path, module_name: str) -> Path | None:
    base = folder.joinpath(*module_name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None
