"""Name -> object registries, so that a config field selects an estimator, an aggregation, an algorithm or an
environment by name, and a user's own is selectable exactly like a shipped one.

A :class:`Registry` belongs to one config field (``algorithm.advantage``, ...). What it accepts there:

- a name registered with its decorator (``@register_advantage("my_baseline")``): the shipped ones, registered
  when the modules that define them are imported (the registry imports them the first time it is asked), and a
  user's, registered when the user's module is imported;
- an import path ``module:attribute`` (``my_rewards:my_baseline``), imported as the environments' are
  (:mod:`teamrl.imports`: the config file's folder and the working directory are searched too) and registered
  under that path.

Anything else is one :class:`RegistryError` naming the field, the value and everything registered. A second
registration of a name that is taken is an error too, unless it is the same definition again (a module
imported twice), so that a user's estimator never silently replaces a shipped one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """A name is not registered (the message lists what is), or is registered twice."""


class Registry(MutableMapping[str, T], Generic[T]):
    """The objects selectable in one config field, by name; a mapping of name -> object.

    ``modules``: the modules whose import registers the shipped entries (imported on first use, so that
    building a registry imports nothing heavy). Each entry may carry properties given at registration
    (``register("rloo", leave_the_sample_out=True)``), read back with :meth:`properties`.
    Setting an item (``registry[name] = obj``) replaces an entry without the duplicate check: it is how tests
    swap one in for a while (``monkeypatch.setitem``).
    """

    def __init__(self, kind: str, field: str, modules: Sequence[str] = ()):
        self.kind = kind
        """What an entry is, for messages ("advantage estimator")."""
        self.field = field
        """The config field that names an entry ("algorithm.advantage")."""
        self._modules = tuple(modules)
        self._entries: dict[str, T] = {}
        self._properties: dict[str, dict[str, Any]] = {}
        self._shipped_loaded = not self._modules

    def register(self, name: str, **properties: Any) -> Callable[[T], T]:
        """A decorator: ``@registry.register("name", **properties)`` makes the decorated object selectable as
        ``name``.

        Raises:
            RegistryError: ``name`` is taken by another definition.
        """

        def wrap(obj: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and not _same_definition(existing, obj):
                raise RegistryError(f"{self.field}: {name!r} is already registered ({_describe(existing)}); "
                                    f"register {_describe(obj)} under another name")
            self._entries[name] = obj
            self._properties[name] = dict(properties)
            return obj

        return wrap

    def resolve(self, name: str) -> str:
        """The registered name that ``name`` selects: ``name`` itself, or an import path ``module:attribute``
        (imported, and registered under that path unless it was registered under a name already).

        Raises:
            RegistryError: ``name`` is neither; the message lists the registered names.
            teamrl.imports.ImportPathError: the import path does not lead to an object.
        """
        self._load_shipped()
        if name in self._entries:
            return name
        from teamrl.imports import is_import_path, load_object

        if not isinstance(name, str) or not is_import_path(name):
            raise RegistryError(f"{self.field}: unknown {self.kind} {name!r}; registered: {', '.join(self)}; or "
                                f"give your own as module:name (docs/algorithm.md#your-own-estimators-and-algorithms)")
        obj = load_object(name, self.field)
        registered = next((key for key, value in self._entries.items() if value is obj), None)
        if registered is not None:  # the module registered it under a name when imported
            return registered
        self.register(name)(obj)
        return name

    def lookup(self, name: str) -> T:
        """The object ``name`` selects (:meth:`resolve`); ``registry[name]`` is the same with a KeyError."""
        return self._entries[self.resolve(name)]

    def properties(self, name: str) -> dict[str, Any]:
        """What entry ``name`` was registered with (``register(name, **properties)``); empty for one set by item or
        given as an import path."""
        return self._properties.get(self.resolve(name), {})

    def _load_shipped(self) -> None:
        if not self._shipped_loaded:
            self._shipped_loaded = True
            for module in self._modules:
                importlib.import_module(module)

    def __getitem__(self, name: str) -> T:
        try:
            return self.lookup(name)
        except RegistryError:
            raise KeyError(name) from None

    def __setitem__(self, name: str, obj: T) -> None:
        self._entries[name] = obj
        self._properties.setdefault(name, {})

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self._properties.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        """The names: the shipped ones in the order of ``modules`` (whatever order they were imported in), then
        the others in the order they were registered."""
        self._load_shipped()
        order = {module: rank for rank, module in enumerate(self._modules)}
        return iter(sorted(self._entries, key=lambda name: order.get(getattr(self._entries[name], "__module__", None),
                                                                      len(order))))

    def __len__(self) -> int:
        self._load_shipped()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load_shipped()
        return name in self._entries


def _same_definition(a: Any, b: Any) -> bool:
    """The same object, or the same module's same definition imported again (a module re-imported under pytest's
    importlib mode, or reloaded): not a conflict."""
    if a is b:
        return True
    return all(getattr(a, key, None) is not None and getattr(a, key, None) == getattr(b, key, None)
               for key in ("__module__", "__qualname__"))


def _describe(obj: Any) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(obj)


# The registries of the config's fields. They live here, in a module that imports nothing heavy, so that a config
# is checked against them without importing torch until a name has to be looked up; the modules that define the
# shipped entries register them when imported, which each registry does the first time it is asked.
ALGORITHMS: Registry[type] = Registry("algorithm", "algorithm.name", modules=(
    "teamrl.algorithms.magrpo", "teamrl.algorithms.centralized", "teamrl.algorithms.actor_critic",
    "teamrl.algorithms.madpo", "teamrl.algorithms.marlhf"))
"""``algorithm.name``: :class:`~teamrl.algorithms.base.Algorithm` classes (``register_algorithm``)."""
ADVANTAGES: Registry[Callable] = Registry("advantage estimator", "algorithm.advantage",
                                          modules=("teamrl.algorithms.advantages",))
"""``algorithm.advantage``: advantage estimators (``register_advantage``)."""
AGGREGATIONS: Registry[Callable] = Registry("log-prob aggregation", "algorithm.logprob_aggregation",
                                            modules=("teamrl.algorithms.losses",))
"""``algorithm.logprob_aggregation``: how a completion's token losses add up (``register_aggregation``)."""
BASELINES: Registry[Callable] = Registry("baseline", "--methods", modules=("teamrl.evaluation.baselines",))
"""``teamrl eval --methods``: the prompt-only team baselines (``register_baseline``)."""
