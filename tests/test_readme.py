"""The README is a front page that stays true: its commands, presets, links and Python example match the code.

Every check but the last is fast (no network, no model beyond the tiny test one); the last, marked slow, trains
the example's team and checks that it learns.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"
MAX_LINES = 150
MAIN_JOB = "pip install torch==2.13.0 && pip install -e . && teamrl demo"
TESTS = "bash scripts/test.sh"


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def example() -> str:
    blocks = code_blocks(README, "python")
    assert len(blocks) == 1, f"README.md should hold one Python example (a ```python block), found {len(blocks)}"
    return blocks[0]


def test_the_readme_is_a_front_page_of_at_most_150_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"README.md has {lines} lines, more than {MAX_LINES}: move the detail into a guide "
                                f"page or a report under docs/ and link to it")


def test_the_readme_gives_the_two_commands_exactly():
    commands = {line.strip() for block in code_blocks(README, "bash") for line in block.splitlines()}
    for command in (MAIN_JOB, TESTS):
        assert command in commands, f"README.md must give `{command}` on a line of its own in a ```bash block"
    assert (ROOT / "scripts" / "test.sh").is_file(), "README.md's test command runs scripts/test.sh: restore it"
    ci = ROOT / ".ci" / "run"
    assert ci.is_file(), "CI runs .ci/run: restore it"
    ci_commands = [line.split("#")[0].strip() for line in ci.read_text().splitlines()]
    assert any(line.startswith(TESTS) and "--slow" not in line for line in ci_commands), \
        f".ci/run must run the README's test command, `{TESTS}`"
    assert any(line.startswith(f"{TESTS} --slow") for line in ci_commands), \
        f".ci/run must run the second stage, `{TESTS} --slow`, as the README says"
    assert "--slow" in README.read_text(), "README.md must say how the slow second stage runs (`--slow`)"


def test_the_readme_names_every_shipped_preset_and_no_other():
    from teamrl.config import presets

    match = re.search(r"^Shipped presets: (.*?)\n\n", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    assert match, "README.md must list the presets in a paragraph that starts 'Shipped presets: '"
    named = sorted(re.findall(r"`(\w+)`", match.group(1)))
    assert named == presets(), (f"README.md's presets paragraph names {named}, src/teamrl/presets holds "
                                f"{presets()}: name each file there once, and nothing else")


def test_the_readmes_train_commands_name_shipped_presets():
    from teamrl.config import presets

    for name in re.findall(r"teamrl train (\w+)", README.read_text(encoding="utf-8")):
        assert name in presets() or name == "CONFIG", f"README.md runs `teamrl train {name}`: no such preset"


def test_every_relative_link_in_the_readme_resolves():
    spec = importlib.util.spec_from_file_location("docs_links", Path(__file__).with_name("test_docs_links.py"))
    docs_links = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_links)
    broken = docs_links.broken_links([README])
    assert not broken, "README.md links that do not resolve (fix the link or the page):\n" + "\n".join(broken)


def test_the_quickstart_repeats_the_readmes_example():
    assert example() in code_blocks(QUICKSTART, "python"), \
        "docs/quickstart.md's Python example must be the README's, character for character: copy it over"


# ------------------------------------------------------------------------------------------------------------
# The example's names and calls, read without running it


def returned_class(function: object) -> type | None:
    """The class ``function`` is annotated to return, when it is one class."""
    try:
        hint = typing.get_type_hints(function).get("return")
    except Exception:  # an annotation that does not resolve at run time: nothing to check against
        return None
    return hint if isinstance(hint, type) else None


def has_member(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, an annotated field, or set in its code."""
    if hasattr(cls, name) or any(name in getattr(base, "__annotations__", {}) for base in cls.__mro__):
        return True
    try:
        return re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(cls)) is not None
    except (OSError, TypeError):
        return True


class ExampleChecker(ast.NodeVisitor):
    """Follows the example's names: what `teamrl` gives it, which class each variable holds, and whether every
    call on them takes the arguments given."""

    def __init__(self):
        self.objects: dict[str, object] = {}  # imported names
        self.instances: dict[str, type] = {}  # variables, by the class of what they hold
        self.problems: list[str] = []

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not (node.module or "").startswith("teamrl"):
            return
        try:
            module = importlib.import_module(node.module)
        except ImportError as err:
            self.problems.append(f"line {node.lineno}: `from {node.module} import ...`: {err}")
            return
        for alias in node.names:
            if not hasattr(module, alias.name):
                self.problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
            else:
                self.objects[alias.asname or alias.name] = getattr(module, alias.name)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        cls = self.type_of(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name):
                if cls is None:
                    self.instances.pop(target.id, None)
                else:
                    self.instances[target.id] = cls

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            cls = self.type_of(item.context_expr)
            if isinstance(item.optional_vars, ast.Name) and cls is not None:
                self.instances[item.optional_vars.id] = returned_class(getattr(cls, "__enter__", None)) or cls
        for statement in node.body:
            self.visit(statement)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        cls = self.type_of(node.value)
        if cls is not None and not has_member(cls, node.attr):
            self.problems.append(f"line {node.lineno}: {cls.__qualname__} has no attribute {node.attr!r}")

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        callee, takes_self = self.callee(node.func)
        if callee is None or any(isinstance(arg, ast.Starred) for arg in node.args) or \
                any(keyword.arg is None for keyword in node.keywords):
            return
        try:
            signature = inspect.signature(callee)
        except (TypeError, ValueError):
            return
        arguments = [None] * (takes_self + len(node.args))
        try:
            signature.bind(*arguments, **{keyword.arg: None for keyword in node.keywords})
        except TypeError as err:
            self.problems.append(f"line {node.lineno}: `{ast.unparse(node)}`: {err} (the signature: "
                                 f"{getattr(callee, '__qualname__', callee)}{signature})")

    def callee(self, func: ast.expr) -> tuple[object | None, bool]:
        """What a call calls, and whether it is a method that takes the instance first."""
        if isinstance(func, ast.Name):
            return self.objects.get(func.id), False
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id in self.objects:
                return getattr(self.objects[func.value.id], func.attr, None), False
            cls = self.type_of(func.value)
            if cls is not None:
                static = inspect.getattr_static(cls, func.attr, None)
                if isinstance(static, (staticmethod, classmethod)):
                    return getattr(cls, func.attr), False
                if inspect.isfunction(static):
                    return static, True
        return None, False

    def type_of(self, node: ast.expr) -> type | None:
        """The class of what ``node`` evaluates to, where the code says."""
        if isinstance(node, ast.Name):
            return self.instances.get(node.id)
        if isinstance(node, ast.Call):
            callee, _ = self.callee(node.func)
            return callee if isinstance(callee, type) else returned_class(callee)
        if isinstance(node, ast.Attribute):
            cls = self.type_of(node.value)
            if cls is not None:
                static = inspect.getattr_static(cls, node.attr, None)
                if isinstance(static, property):
                    return returned_class(static.fget)
                try:
                    hint = typing.get_type_hints(cls).get(node.attr)
                except Exception:
                    return None
                return hint if isinstance(hint, type) else None
        return None


def test_the_python_examples_names_exist_and_its_calls_match_their_signatures():
    tree = ast.parse(example())
    checker = ExampleChecker()
    checker.visit(tree)
    assert checker.objects, "README.md's Python example imports nothing from teamrl"
    assert not checker.problems, "README.md's Python example does not match the code (fix the example, or the " \
        "API it shows):\n" + "\n".join(checker.problems)


def test_the_python_example_runs_with_training_left_out(tmp_path, monkeypatch, capsys):
    """Every line of the example runs against the code as it is, on the tiny model, with `train()` skipped (the
    slow test below trains)."""
    from teamrl.train import Trainer

    monkeypatch.setattr(Trainer, "train", lambda self, *args, **kwargs: [])
    monkeypatch.chdir(tmp_path)
    exec(compile(example(), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"held-out joint reward [\d.]+ -> [\d.]+", printed), printed
    assert (tmp_path / "runs/readme/team/team.json").is_file()


@pytest.mark.slow
def test_readme_python_example_trains_a_team(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(example(), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    before, after = map(float, re.search(r"held-out joint reward ([\d.]+) -> ([\d.]+)", printed).groups())
    assert after > before + 0.5, printed
    assert (tmp_path / "runs/readme/team/team.json").exists()
