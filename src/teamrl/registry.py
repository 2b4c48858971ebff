"""Name -> object registries, so configs can select estimators, aggregations and environments by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def registrar(table: dict[str, T]) -> Callable[[str], Callable[[T], T]]:
    """A decorator factory: ``@register("name")`` stores the decorated object in ``table`` under ``name``."""

    def register(name: str) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            table[name] = obj
            return obj

        return wrap

    return register
