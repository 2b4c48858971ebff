"""Old import paths that still work for one release, each with a DeprecationWarning naming the new one.

Issue #47 moved the rollout tree (``teamrl.rollout.tree``), the update (``teamrl.algorithms.update``) and the
backends (``teamrl.backends``); code that imports a name from where it was keeps running and is told where
the name lives now. Nothing inside teamrl imports through these paths (tests/test_deprecated_paths.py).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) for ``module``, whose ``names`` moved: each maps to the
    ``new.module:attribute`` it is now. Getting one warns (DeprecationWarning, at the caller's line) and returns
    the object from its new home; any other name is an AttributeError, as usual."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, attribute = names[name].partition(":")
        warnings.warn(f"{module}.{name} moved to {new_module}.{attribute}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        value: Any = importlib.import_module(new_module)
        for part in attribute.split("."):
            value = getattr(value, part)
        return value

    return __getattr__


def team_sampler(team: Any) -> Callable[..., Any]:
    """What ``teamrl.algorithms.magrpo.team_sampler(team)`` returned: now ``functools.partial(sample_team, team)``
    (:func:`teamrl.rollout.generate.sample_team`)."""
    import functools

    from teamrl.rollout.generate import sample_team

    return functools.partial(sample_team, team)
