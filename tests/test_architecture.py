"""The package's shape, checked: data flows one way (task -> rollout -> algorithms -> backends -> the Trainer), no
import circle spans two parts of the package, and the names issue #47 moved still import from where they were,
with a DeprecationWarning, while nothing inside teamrl imports through those old paths.

The import graph is read from the source (every import: module level, inside functions, and under
``TYPE_CHECKING``), so a type-only import that climbs back up counts too: it is still a reader's detour.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

import teamrl

PACKAGE = Path(teamrl.__file__).resolve().parent

#: What each part may not import (its own modules and everything below it are fine).
FORBIDDEN = {
    "teamrl.envs": ("teamrl.rollout", "teamrl.algorithms", "teamrl.backends", "teamrl.train", "teamrl.evaluation",
                    "teamrl.serve", "teamrl.cli"),
    "teamrl.rollout": ("teamrl.algorithms", "teamrl.backends", "teamrl.train", "teamrl.evaluation", "teamrl.serve"),
    "teamrl.algorithms": ("teamrl.backends", "teamrl.train", "teamrl.evaluation", "teamrl.serve", "teamrl.cli"),
    "teamrl.backends": ("teamrl.train", "teamrl.evaluation", "teamrl.serve", "teamrl.cli"),
    "teamrl.config": ("teamrl.algorithms", "teamrl.backends", "teamrl.envs", "teamrl.team", "teamrl.train"),
    "teamrl.registry": ("teamrl.algorithms", "teamrl.backends", "teamrl.envs", "teamrl.config"),
}

#: Modules that only forward old import paths (issue #47).
DEPRECATED_MODULES = ("teamrl.backend", "teamrl.distributed", "teamrl.distributed.ray_team",
                      "teamrl.rollout.vllm_backend", "teamrl.serve.vllm_backend", "teamrl.evaluation.schemes")

#: (old module, name, new module, new name): a sample of every kind of move.
MOVED = [
    ("teamrl.algorithms.magrpo", "rollout", "teamrl.rollout.tree", "sample_tree"),
    ("teamrl.algorithms.magrpo", "Rollout", "teamrl.rollout.tree", "RolloutTree"),
    ("teamrl.algorithms.magrpo", "Turn", "teamrl.rollout.tree", "Turn"),
    ("teamrl.algorithms.magrpo", "update_agent", "teamrl.algorithms.update", "update_agent"),
    ("teamrl.algorithms.magrpo", "NonFiniteUpdate", "teamrl.algorithms.update", "NonFiniteUpdate"),
    ("teamrl.algorithms.advantages", "joint_action_combos", "teamrl.rollout.tree", "joint_action_combos"),
    ("teamrl.backend", "LocalBackend", "teamrl.backends.local", "LocalBackend"),
    ("teamrl.backend", "AgentBackend", "teamrl.algorithms.base", "AgentBackend"),
    ("teamrl.backend", "make_optimizer", "teamrl.algorithms.update", "make_optimizer"),
    ("teamrl.backend", "make_backend", "teamrl.backends", "make_backend"),
    ("teamrl.rollout.vllm_backend", "VLLMSampler", "teamrl.rollout.vllm_sampler", "VLLMSampler"),
    ("teamrl.serve.vllm_backend", "VLLMBackend", "teamrl.serve.vllm_proxy", "VLLMProxy"),
    ("teamrl.evaluation.schemes", "classify_scheme", "teamrl.envs.code_schemes", "classify_scheme"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """teamrl module -> the teamrl modules it imports (a name imported from a package counts as its module when
    it is one)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                found = owner(target) if target.startswith("teamrl") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for vertex in list(graph):
        if vertex not in index:
            visit(vertex)
    return found


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_each_part_imports_only_what_lies_below_it():
    graph = import_graph()
    climbs = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                    for part, forbidden in FORBIDDEN.items()
                    if _part(module) == part and target.startswith(forbidden))
    assert climbs == []


def test_no_import_circle_spans_two_parts_of_the_package():
    # Circles inside one part are a package importing its own modules (envs/__init__ registers the tasks); the one
    # pair across parts is type-only: a prompt stem returns the Generation type the sampler defines.
    allowed = [{"teamrl.models.stem", "teamrl.rollout.generate"}]
    across = [sorted(component) for component in strongly_connected(import_graph())
              if len({_part(module) for module in component}) > 1 and component not in allowed]
    assert across == []


def test_nothing_in_teamrl_imports_through_an_old_path():
    graph = import_graph()
    through_old = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                         if target in DEPRECATED_MODULES and module not in DEPRECATED_MODULES)
    assert through_old == []
    moved_from_module = {(old, name) for old, name, _, _ in MOVED if old not in DEPRECATED_MODULES}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    assert (node.module, alias.name) not in moved_from_module, f"{path}: {node.module}.{alias.name}"


@pytest.mark.parametrize(("old", "name", "new", "new_name"), MOVED)
def test_an_old_import_path_still_works_and_says_where_the_name_went(old, name, new, new_name):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{new_name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), new_name)


def test_an_unknown_name_of_an_old_module_is_still_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module("teamrl.backend")
        with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
            module.nothing  # noqa: B018


def test_the_old_team_sampler_samples_as_sample_team_does(lora_team):
    from teamrl.algorithms import magrpo
    from teamrl.rollout.generate import sample_team

    team = lora_team()
    with pytest.warns(DeprecationWarning, match="team_sampler"):
        sample = magrpo.team_sampler(team)
    observations = [["a b"], ["c d"]]
    old = sample(observations, 2, 7)
    new = sample_team(team, observations, 2, 7)
    assert [gen.texts for gen in old] == [gen.texts for gen in new]
