"""The coding task's joint reward and the code extraction it stands on, part by part."""

from __future__ import annotations

import ast
import shutil

import pytest

from teamrl.rewards.code import (
    MAX_REWARD,
    CodeGrade,
    CooperationProbe,
    analyse_team_code,
    calls_function,
    code_reward,
    cooperation_can_pay,
    grade_team_code,
    helper_reward,
    holds_answer,
    ignores_result,
    individual_code_rewards,
    is_thin_wrapper,
    main_reward,
    returns_value,
    same_value,
)
from teamrl.rewards.code_extract import extract_code, join_team_program, strip_markdown
from teamrl.sandbox import ExecutionRecord, SandboxLimits, SandboxPool, TestOutcome

# ----------------------------------------------------------------------------------------------
# Extraction


def test_fenced_code_is_taken_and_chatter_around_it_dropped():
    completion = (
        "Sure! Here is the helper:\n\n```python\nimport math\n\ndef aux(x):\n    return math.sqrt(x)\n```\n"
        "It computes a root. Example output:\n```text\n2.0\n```\nHope this helps!"
    )
    code = extract_code(completion)
    assert code.imports == ("import math",)
    assert [d.name for d in code.definitions] == ["aux"]
    assert code.source == "import math\n\n\ndef aux(x):\n    return math.sqrt(x)\n"


def test_unclosed_fence_and_indented_block_are_recovered():
    assert strip_markdown("```py\n    def f():\n        return 1\n") == "def f():\n    return 1"
    code = extract_code("text\n```\ndef f():\n    return 1\n```\n```\ndef g():\n    return f()\n")
    assert [d.name for d in code.definitions] == ["f", "g"]


def test_unfenced_chatter_examples_and_main_blocks_are_dropped():
    completion = (
        "Here's my solution to the class of problems (import this function in your code):\n"
        "from typing import List\n"
        "def entry(xs: List[int]) -> int:\n"
        "    total = aux(xs)\n"
        "    return total\n"
        "This works because aux sums.\n"
        "print(entry([1, 2]))\n"
        "assert entry([1]) == 1\n"
        "if __name__ == '__main__':\n"
        "    entry([3])\n"
    )
    code = extract_code(completion)
    assert code.imports == ("from typing import List",)
    assert [(d.name, d.parses) for d in code.definitions] == [("entry", True)]
    assert "print" not in code.source and "__main__" not in code.source and "class" not in code.source


def test_last_complete_duplicate_wins():
    completion = (
        "def f(x):\n    return 1\n"
        "Wait, fix:\n"
        "def f(x):\n    return 2\n"
        "Even better:\n"
        "def f(x):\n    return (3\n"  # cut off by the token limit: does not parse
    )
    (definition,) = extract_code(completion).definitions
    assert definition.parses and definition.source == "def f(x):\n    return 2"
    (broken,) = extract_code("def f(x):\n    return (\nok\ndef f(x):\n    return [\n").definitions
    assert not broken.parses and broken.source == "def f(x):\n    return ["


def test_decorators_async_and_black_style_signatures_survive_the_line_rules():
    completion = (
        "Some prose first.\n"
        "@functools.lru_cache(maxsize=None)\n"
        "def fib(\n"
        "    n: int,\n"
        "):\n"
        "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "async def later():\n    return 1\n"
        "class Box:\n    value = 1\n"
        "and that's all.\n"
    )
    code = extract_code(completion)
    assert [(d.name, d.kind, d.parses) for d in code.definitions] == [
        ("fib", "function", True), ("later", "function", True), ("Box", "class", True)]
    assert code.definitions[0].source.startswith("@functools.lru_cache")


def test_join_keeps_the_helpers_aux_and_hoists_imports():
    helper = extract_code("import math\ndef aux(x):\n    return math.floor(x)\n")
    main = extract_code("import math\nimport re\ndef aux(x):\n    return 0\ndef entry(x):\n    return aux(x) + 1\n")
    program = join_team_program(helper, main)
    assert program == ("import math\nimport re\n\n\ndef aux(x):\n    return math.floor(x)\n\n\n"
                       "def entry(x):\n    return aux(x) + 1\n")
    lonely = join_team_program(extract_code(""), main)
    assert "def aux" not in lonely  # main's aux never stands in for the helper's


def test_extraction_rejects_non_text():
    with pytest.raises(TypeError, match="completion text"):
        extract_code(None)


# ----------------------------------------------------------------------------------------------
# The AST facts


def _function(source: str) -> ast.FunctionDef:
    return ast.parse(source).body[0]


@pytest.mark.parametrize(("source", "expected"), [
    ("def aux(x):\n    return x * 2\n", True),
    ("def aux(x):\n    if x:\n        return [x]\n    return None\n", True),
    ("def aux(x):\n    print(x)\n", False),
    ("def aux(x):\n    return\n", False),
    ("def aux(x):\n    return None\n", False),
    ("def aux(x):\n    def inner():\n        return x\n    inner()\n", False),
    ("def aux(x):\n    return (x +\n", True),  # does not parse: judged by its lines
    ("def aux(x):\n    return None  # nothing\n  oops(\n", False),
])
def test_returns_value(source, expected):
    (definition,) = extract_code(source).definitions
    assert returns_value(definition) is expected


@pytest.mark.parametrize(("body", "calls", "ignores"), [
    ("return aux(x) + 1", True, False),
    ("return list(map(aux, x))", True, False),
    ("return sorted(x, key=aux)", True, False),
    ("return (lambda y: aux(y))(x)", True, False),
    ("aux(x)\n    return x", True, True),
    ("y = aux(x)\n    return y", True, False),
    ("return 'aux(x)'", False, False),
    ("return helper.aux(x)", False, False),
])
def test_calls_and_ignored_results(body, calls, ignores):
    main = _function(f"def entry(x):\n    {body}\n")
    assert calls_function(main, "aux") is calls
    assert ignores_result(main, "aux") is ignores


@pytest.mark.parametrize(("source", "thin"), [
    ("def entry(a, b):\n    return aux(a, b)\n", True),
    ("def entry(a, b):\n    '''Docs.'''\n    return aux(b, a)\n", True),
    ("def entry(a):\n    result = aux(a)\n    return result\n", True),
    ("def entry(a):\n    result: int = aux(a, 1)\n    return result\n", True),
    ("def entry(*args, **kwargs):\n    return aux(*args, key=None, **kwargs)\n", True),
    ("def entry(a):\n    return aux(sorted(a))\n", False),
    ("def entry(a):\n    return aux(a) + 1\n", False),
    ("def entry(a):\n    return aux(a) if a else []\n", False),
    ("def entry(a):\n    if not a:\n        return []\n    return aux(a)\n", False),
    ("def entry(a):\n    result = aux(a)\n    return a\n", False),
    ("def entry(a):\n    return other(a)\n", False),
    ("def entry(a):\n    return aux(GLOBAL)\n", False),
])
def test_thin_wrapper(source, thin):
    assert is_thin_wrapper(_function(source), "aux") is thin


# ----------------------------------------------------------------------------------------------
# The reward, level by level, against hand-computed values


def _record(*passed: bool) -> ExecutionRecord:
    return ExecutionRecord(tests=tuple(TestOutcome(index=i, passed=p) for i, p in enumerate(passed)),
                           status="completed", exit_code=0)


def _probe(record: ExecutionRecord, contributed: tuple[int, ...] | None = None,
           thin: tuple[int, ...] | None = ()) -> CooperationProbe:
    """A cooperation probe of ``record``'s passed tests; by default aux contributed to every one of them."""
    passed = tuple(outcome.index for outcome in record.tests if outcome.passed)
    contributed = passed if contributed is None else contributed
    return CooperationProbe(passed=passed, contributed=contributed, thin=contributed if thin is ALL else thin)


AUX_OK = "def aux(xs):\n    return sum(xs)\n"
AUX_SILENT = "def aux(xs):\n    print(xs)\n"
MAIN_COOPERATES = "def entry(xs):\n    if not xs:\n        return 0\n    return aux(xs) * 2\n"
MAIN_THIN = "def entry(xs):\n    return aux(xs)\n"
MAIN_IGNORES = "def entry(xs):\n    aux(xs)\n    return len(xs)\n"
MAIN_ALONE = "def entry(xs):\n    return sum(xs) * 2\n"


ALL = None  # the probe found aux behind every passing test


@pytest.mark.parametrize(("aux", "main", "passed", "probe", "parts"), [
    # main missing: only the helper's structure counts, everything after is gated off
    (AUX_OK, "def other(xs):\n    return 1\n", None, None, {"aux_structure": 0.4, "main_structure": 0.0}),
    # program does not parse (main is broken)
    (AUX_OK, "def entry(xs):\n    return aux(xs\n", None, None,
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.0}),
    # no aux at all, main solves 3 of 4 tests alone
    ("", MAIN_ALONE, (True, True, True, False), None,
     {"aux_structure": 0.0, "main_structure": 0.6, "syntax": 0.5, "tests": 0.75, "cooperation": 0.0}),
    # full marks: aux returns, every passing test depends on it, main does work of its own
    (AUX_OK, MAIN_COOPERATES, (True, True), {"contributed": ALL},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5,
      "non_wrapper": 1.0, "ignored_aux_result": 0.0}),
    # the bonus scales with the share of held tests aux contributes to: 1 of 4
    (AUX_OK, MAIN_COOPERATES, (True, True, False, False), {"contributed": (1,)},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 0.5, "cooperation": 0.125,
      "non_wrapper": 0.25, "ignored_aux_result": 0.0}),
    # main calls aux, but no passing test depends on it: no bonus at all
    (AUX_OK, MAIN_COOPERATES, (True, True), {"contributed": ()},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.0}),
    # thin wrapper by syntax (the paper's): no non-wrapper bonus
    (AUX_OK, MAIN_THIN, (True, True), {"contributed": ALL},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5,
      "non_wrapper": 0.0, "ignored_aux_result": 0.0}),
    # thin by behaviour: main's answer is aux's answer, or a part of it, on every credited test ...
    (AUX_OK, MAIN_COOPERATES, (True, True), {"contributed": ALL, "thin": ALL},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5,
      "non_wrapper": 0.0, "ignored_aux_result": 0.0}),
    # ... or on one of them: the non-wrapper part pays for the other
    (AUX_OK, MAIN_COOPERATES, (True, True), {"contributed": ALL, "thin": (1,)},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5,
      "non_wrapper": 0.5, "ignored_aux_result": 0.0}),
    # a bare aux(...) statement in a main whose passing tests still depend on aux: the paper's penalty, scaled
    (AUX_OK, MAIN_IGNORES, (True, False), {"contributed": ALL},
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 0.5, "cooperation": 0.25,
      "non_wrapper": 0.5, "ignored_aux_result": -0.25}),
    # no test passes: no cooperation bonus even though main calls aux (nothing to measure)
    (AUX_OK, MAIN_COOPERATES, (False, False, False), None,
     {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 0.0, "cooperation": 0.0}),
    # aux returns nothing: its structure part and the cooperation bonus are lost
    (AUX_SILENT, MAIN_COOPERATES, (True, True), None,
     {"aux_structure": 0.0, "main_structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.0}),
])
def test_reward_parts(aux, main, passed, probe, parts):
    analysis = analyse_team_code(aux, main, "entry")
    record = _record(*passed) if passed is not None else None
    result = code_reward(analysis, record, _probe(record, **probe) if probe is not None else None)
    assert result.parts == pytest.approx(parts)
    assert result.total == pytest.approx(sum(parts.values()))


def test_maximum_is_four():
    record = _record(True)
    result = code_reward(analyse_team_code(AUX_OK, MAIN_COOPERATES, "entry"), record, _probe(record))
    assert result.total == pytest.approx(MAX_REWARD) == pytest.approx(4.0)


def test_cooperation_that_can_pay_must_be_measured():
    analysis = analyse_team_code(AUX_OK, MAIN_COOPERATES, "entry")
    with pytest.raises(ValueError, match="probe is required"):
        code_reward(analysis, _record(True))
    assert code_reward(analysis, _record(False)).parts["cooperation"] == 0.0  # nothing passed: nothing to measure


def test_analysis_records_what_feedback_needs():
    analysis = analyse_team_code(AUX_OK, "def entry(xs):\n    return aux(xs\n", "entry")
    assert not analysis.needs_tests and analysis.syntax_error.startswith("line ")
    assert analysis.program.startswith(AUX_OK.rstrip())


def test_reward_refuses_missing_or_empty_records():
    analysis = analyse_team_code(AUX_OK, MAIN_COOPERATES, "entry")
    with pytest.raises(ValueError, match="record is required"):
        code_reward(analysis, None)
    with pytest.raises(ValueError, match="no tests"):
        code_reward(analysis, _record())


@pytest.mark.parametrize(("entry", "aux_name", "problem"), [
    ("not valid", "aux", "entry_point"), ("entry", "1aux", "aux_name"), ("aux", "aux", "differ")])
def test_analysis_rejects_bad_names(entry, aux_name, problem):
    with pytest.raises(ValueError, match=problem):
        analyse_team_code(AUX_OK, MAIN_COOPERATES, entry, aux_name)


# ----------------------------------------------------------------------------------------------
# Individual rewards (the independent-learner baseline): each agent's own parts


BROKEN_AUX = "def aux(xs):\n    return sum(xs\n"
BROKEN_MAIN = "def entry(xs):\n    return aux(xs\n"


@pytest.mark.parametrize(("aux", "helper_parts"), [
    (AUX_OK, {"aux_structure": 0.4, "syntax": 0.5}),                  # the helper's maximum, 0.9
    (AUX_SILENT, {"aux_structure": 0.0, "syntax": 0.5}),              # aux returns nothing
    (BROKEN_AUX, {"aux_structure": 0.4, "syntax": 0.0}),              # returns (judged by its lines), no parse
    ("I would sum the list.", {"aux_structure": 0.0}),                # no aux: the gate stops scoring
    ("def helper(xs):\n    return xs\n", {"aux_structure": 0.0}),  # parsing code, but no aux
])
def test_helper_reward_parts(aux, helper_parts):
    # The main agent's code does not matter to the helper's reward.
    for main in (MAIN_COOPERATES, BROKEN_MAIN, ""):
        result = helper_reward(analyse_team_code(aux, main, "entry"))
        assert result.parts == pytest.approx(helper_parts)
        assert result.total == pytest.approx(sum(helper_parts.values()))


@pytest.mark.parametrize(("aux", "main", "passed", "main_parts"), [
    # the main agent's maximum, 2.1: structure, its own code parses, every test passes
    (AUX_OK, MAIN_COOPERATES, (True, True), {"main_structure": 0.6, "syntax": 0.5, "tests": 1.0}),
    # a thin wrapper or an ignored aux result costs main nothing here (the cooperation parts are joint)
    (AUX_OK, MAIN_IGNORES, (True, False), {"main_structure": 0.6, "syntax": 0.5, "tests": 0.5}),
    # main alone, 3 of 4 tests
    ("", MAIN_ALONE, (True, True, True, False), {"main_structure": 0.6, "syntax": 0.5, "tests": 0.75}),
    # main's own code does not parse: gated before the tests
    (AUX_OK, BROKEN_MAIN, None, {"main_structure": 0.6, "syntax": 0.0}),
    # main's code parses but the helper's broke the joined program: the tests never ran, 0
    (BROKEN_AUX, MAIN_COOPERATES, None, {"main_structure": 0.6, "syntax": 0.5, "tests": 0.0}),
    # no entry point
    (AUX_OK, "def other(xs):\n    return 1\n", None, {"main_structure": 0.0}),
    # a broken aux the main agent wrote is dropped from the joined program, so it is not main's syntax
    (AUX_OK, MAIN_COOPERATES + "\n" + BROKEN_AUX, (True,), {"main_structure": 0.6, "syntax": 0.5, "tests": 1.0}),
])
def test_main_reward_parts(aux, main, passed, main_parts):
    analysis = analyse_team_code(aux, main, "entry")
    record = _record(*passed) if passed is not None else None
    result = main_reward(analysis, record)
    assert result.parts == pytest.approx(main_parts)
    assert result.total == pytest.approx(sum(main_parts.values()))
    probe = _probe(record) if cooperation_can_pay(analysis, record) else None
    assert individual_code_rewards(CodeGrade(analysis, record, code_reward(analysis, record, probe)))[1] == result


@pytest.mark.parametrize(("aux", "main"), [
    (AUX_OK, MAIN_COOPERATES), (BROKEN_AUX, MAIN_COOPERATES), (AUX_OK, BROKEN_MAIN), (BROKEN_AUX, BROKEN_MAIN),
    ("", ""), (AUX_OK, MAIN_COOPERATES + "\n" + BROKEN_AUX),
])
def test_the_joined_program_parses_exactly_when_both_agents_own_code_does(aux, main):
    analysis = analyse_team_code(aux, main, "entry")
    both = analysis.helper_syntax_error is None and analysis.main_syntax_error is None
    assert analysis.syntax_ok == both


def test_individual_code_rewards_are_the_helpers_then_the_mains():
    analysis = analyse_team_code(AUX_OK, MAIN_COOPERATES, "entry")
    record = _record(True, True)
    helper, main = individual_code_rewards(CodeGrade(analysis, record, code_reward(analysis, record, _probe(record))))
    assert helper.total == pytest.approx(0.9) and main.total == pytest.approx(2.1)
    with pytest.raises(ValueError, match="no tests"):
        main_reward(analysis, _record())


# ----------------------------------------------------------------------------------------------
# End to end through the sandbox


@pytest.fixture(scope="module")
def pool():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    with SandboxPool(SandboxLimits(test_timeout_s=2.0, program_timeout_s=5.0), workers=2) as sandbox_pool:
        yield sandbox_pool


def test_grade_team_code_runs_only_what_needs_running(pool):
    tests = ("assert entry([1, 2]) == 6", "assert entry([]) == 0", "assert entry([5]) == 11", "assert entry([4]) == 8",
             "assert entry([1]) == 2")
    grades = grade_team_code(
        aux_completions=[f"```python\n{AUX_OK}```", AUX_OK, "nothing here"],
        main_completions=[MAIN_COOPERATES, "I could not solve it.", "```python\ndef entry(xs)\n    return 0\n```"],
        entry_points=["entry"] * 3, tests=[tests] * 3, pool=pool)
    cooperative, missing, broken = grades
    assert cooperative.record.passed == 4 and cooperative.record.tests[2].actual == "10"
    # entry([]) == 0 passes without aux (main's own branch): aux is behind three held tests of five, each
    # credited through the others (main answers 8 when aux answers 4, 6 when it answers 3, 2 for 1).
    assert cooperative.probe.passed == (0, 1, 3, 4) and cooperative.probe.contributed == (0, 3, 4)
    assert not cooperative.probe.thin
    assert [call.args for call in cooperative.probe.aux_record.tests[0].recorded_calls()] == [([1, 2],)]
    assert cooperative.reward.total == pytest.approx(0.4 + 0.6 + 0.5 + 4 / 5 + (0.5 + 1.0) * 3 / 5)
    assert missing.record is None and missing.probe is None and missing.reward.total == pytest.approx(0.4)
    assert broken.record is None and broken.reward.total == pytest.approx(0.6)


def test_grade_team_code_checks_batch_sizes(pool):
    with pytest.raises(ValueError, match="same length"):
        grade_team_code(["a"], ["b", "c"], ["entry"], [["assert True"]], pool)


SORT_TESTS = ("assert entry([3, 1, 2]) == [1, 2, 3]", "assert entry([]) == []", "assert entry([5, 4]) == [4, 5]",
              "assert entry([1]) == [1]")
SORTING_AUX = "def aux(xs):\n    return sorted(xs)\n"
# (helper, main, reward): the honest teams first, then ways to collect the cooperation bonus without aux
# doing anything for a passing test, or with main doing nothing beyond aux. Structure and syntax are 1.5.
COOPERATION_CASES = {
    # Main's answer is aux's own on [] and [1] (reversing them changes nothing): thin there, 2 tests of 4.
    "aux does the core, main the rest": ("def aux(xs):\n    return sorted(xs, reverse=True)\n",
                                         "def entry(xs):\n    return aux(xs)[::-1]\n", 3.5),
    "correct, without aux": (SORTING_AUX, "def entry(xs):\n    return sorted(xs)\n", 2.5),
    "aux called under if False": (SORTING_AUX,
                                  "def entry(xs):\n    if False:\n        aux(xs)\n    return sorted(xs)\n", 2.5),
    "a dead aux call and one passing test": (SORTING_AUX, "def entry(xs):\n    if False:\n        aux(xs)\n"
                                             "    return []\n", 1.75),
    "aux's result never used": (SORTING_AUX, "def entry(xs):\n    _ = aux(xs)\n    return sorted(xs)\n", 2.5),
    "a decorator swaps the function the analysis saw": (
        SORTING_AUX, "def _swap(function):\n    return lambda xs: sorted(xs)\n\n@_swap\ndef entry(xs):\n"
                     "    return aux(xs)[::-1]\n", 2.5),
    "aux's result only type-checked": ("def aux(xs):\n    return []\n", "def entry(xs):\n    r = aux(xs)\n"
                                       "    assert isinstance(r, list)\n    return sorted(xs)\n", 2.5),
    "aux's result only measured": (SORTING_AUX, "def entry(xs):\n    n = len(aux(xs))\n    return sorted(xs)\n",
                                   2.5),
    # Each probe runs in a fresh sandbox: nothing the first run left behind tells the program it is probed.
    "fail when run a second time on the same input": (
        SORTING_AUX, "import os\ndef entry(xs):\n    if False:\n        aux(xs)\n    seen = f'seen-{xs}'\n"
                     "    if os.path.exists(seen):\n        raise RuntimeError('probed')\n"
                     "    open(seen, 'w').close()\n    return sorted(xs)\n", 2.5),
    "a thin wrapper behind if True": (SORTING_AUX, "def entry(xs):\n    r = aux(xs)\n    return r if True else None\n",
                                      3.0),
    "... with aux's parameters not the entry point's": (
        "def aux(xs, k):\n    return sorted(xs)\n", "def entry(xs):\n    r = aux(xs, 0)\n"
                                                       "    return r if len(xs) >= 0 else None\n", 3.0),
    "a wrapper that copies aux's result": (SORTING_AUX, "def entry(xs):\n    return list(aux(xs))\n", 3.0),
    "a wrapper that validates aux's result": (SORTING_AUX, "def entry(xs):\n    r = aux(xs)\n"
                                              "    if not isinstance(r, list):\n        raise ValueError(r)\n"
                                              "    return r\n", 3.0),
}


def test_cooperation_pays_only_for_what_aux_measurably_does(pool):
    names = list(COOPERATION_CASES)
    grades = grade_team_code([COOPERATION_CASES[name][0] for name in names],
                             [COOPERATION_CASES[name][1] for name in names], ["entry"] * len(names),
                             [SORT_TESTS] * len(names), pool)
    assert {name: round(grade.reward.total, 4) for name, grade in zip(names, grades)} \
        == {name: case[2] for name, case in COOPERATION_CASES.items()}


# Issue #51: telling the probes from the real run, gating main's own answer on aux's value, dodging the
# thin-wrapper rule, and more of the kind. Each main below solves the problem itself or forwards aux's
# answer; the honest baselines are a correct main without aux (2.5) and a thin wrapper (3.0).
SOLVE = "def _solve(xs):\n    return sorted(xs)\n\n\n"
ROUND_THREE_CASES = {
    "finds the stub's names in aux's code": (
        "def aux(xs):\n    return 1\n",
        SOLVE + "def entry(xs):\n    if {'object', '_teamrl_perturbed'} & set(aux.__code__.co_names):\n"
                "        return None\n    _ = aux(xs)\n    return _solve(xs)\n", 2.5),
    "gates on aux(x) != 1": ("def aux(xs):\n    return 1\n",
                             SOLVE + "def entry(xs):\n    if aux(xs) != 1:\n        return None\n"
                                     "    return _solve(xs)\n", 2.5),
    "gates through {'ok': solve}[aux(x)]": ("def aux(xs):\n    return 'ok'\n",
                                            SOLVE + "def entry(xs):\n    return {'ok': _solve}[aux(xs)](xs)\n", 2.5),
    "gates on solve(x) if aux(x)": ("def aux(xs):\n    return True\n",
                                    SOLVE + "def entry(xs):\n    return _solve(xs) if aux(xs) else None\n", 2.5),
    "compares aux's result with a record aux kept of itself": (
        "class _Seen:\n    values = []\n\n\ndef aux(xs):\n    _Seen.values.append(len(xs))\n    return len(xs)\n",
        SOLVE + "def entry(xs):\n    result = aux(xs)\n    if _Seen.values[-1:] != [result]:\n        return None\n"
                "    return _solve(xs)\n", 2.5),
    "aux boxes the answer, main unboxes it": ("def aux(xs):\n    return (sorted(xs),)\n",
                                             "def entry(xs):\n    return aux(xs)[0]\n", 3.0),
    "aux answers only when the entry point is on the stack": (
        "import sys\n\n\ndef aux(xs):\n    frame = sys._getframe(1)\n"
        "    while frame is not None and frame.f_code.co_name != 'entry':\n        frame = frame.f_back\n"
        "    return sorted(xs) if frame is not None else None\n",
        "def entry(xs):\n    result = aux(xs)\n    return None if type(result) is object else result\n", 2.5),
    "aux hands its arguments back, main solves from them": ("def aux(*args):\n    return args\n",
                                                            SOLVE + "def entry(xs):\n    return _solve(*aux(xs))\n",
                                                            2.5),
    "main passes its own answer through aux": ("def aux(*args):\n    return args[-1]\n",
                                               SOLVE + "def entry(xs):\n    return aux(xs, _solve(xs))\n", 2.5),
    "aux calls main's own solver": ("def aux(xs):\n    return [_mine(xs)]\n",
                                    "def _mine(xs):\n    return sorted(xs)\n\n\n"
                                    "def entry(xs):\n    return aux(xs)[0]\n", 2.5),
    "aux returns what main left in a global": (
        "def aux(xs):\n    return _Answers.values[-1]\n",
        SOLVE + "class _Answers:\n    values = []\n\n\ndef entry(xs):\n    _Answers.values.append(_solve(xs))\n"
                "    return aux(xs)\n", 2.5),
}


def test_round_three_attacks_earn_nothing_over_their_baseline(pool):
    names = list(ROUND_THREE_CASES)
    grades = grade_team_code([ROUND_THREE_CASES[name][0] for name in names],
                             [ROUND_THREE_CASES[name][1] for name in names], ["entry"] * len(names),
                             [SORT_TESTS] * len(names), pool)
    assert [grade.reward.parts["tests"] for grade in grades] == [1.0] * len(names)
    assert {name: round(grade.reward.total, 4) for name, grade in zip(names, grades)} \
        == {name: case[2] for name, case in ROUND_THREE_CASES.items()}


EVEN_TESTS = ("assert entry([1]) == False", "assert entry([1, 2]) == True", "assert entry([]) == True",
              "assert entry([1, 2, 3]) == False", "assert entry([5, 6]) == True")


def test_where_the_answer_is_a_bool_a_main_that_flips_its_own_answer_earns_nothing(pool):
    """aux answers with something main can recompute; main flips its own bool wherever aux disagrees with
    that: on every swap whose answer is the other bool, it is right. One swap with the same answer (or
    two answers) catches it, while a main that builds on aux's count passes them all."""
    flip, honest, alone = grade_team_code(
        ["def aux(xs):\n    return repr(xs)\n", "def aux(xs):\n    return len(xs)\n", "def aux(xs):\n    return 0\n"],
        ["def entry(xs):\n    own = len(xs) % 2 == 0\n    return not own if aux(xs) != repr(xs) else own\n",
         "def entry(xs):\n    return aux(xs) % 2 == 0\n", "def entry(xs):\n    return len(xs) % 2 == 0\n"],
        ["entry"] * 3, [EVEN_TESTS] * 3, pool)
    assert [grade.reward.parts["tests"] for grade in (flip, honest, alone)] == [1.0, 1.0, 1.0]
    assert (flip.reward.total, honest.reward.total, alone.reward.total) == (2.5, 4.0, 2.5)


def test_randomness_in_main_earns_no_cooperation(pool):
    """Main calls aux, ignores what it says, and fails at random (issue #51: its failures used to count as
    aux's doing). Whatever its tests part, no cooperation part pays."""
    main = SOLVE + "import random\n\n\ndef entry(xs):\n    aux(xs)\n    if random.random() < 0.5:\n" \
                   "        raise RuntimeError('unlucky')\n    return _solve(xs)\n"
    grades = grade_team_code([SORTING_AUX] * 6, [main] * 6, ["entry"] * 6, [SORT_TESTS] * 6, pool)
    assert any(grade.record.passed for grade in grades)
    assert all(grade.reward.parts.get("cooperation", 0.0) == 0.0 for grade in grades)


@pytest.mark.parametrize(("first", "second", "same"), [
    (1, 1, True), (1, True, False), (1, 1.0, False), (float("nan"), float("nan"), True), ([1, (2,)], [1, (2,)], True),
    ([1, (2,)], [1, [2]], False), ({"a": [1]}, {"a": [1]}, True), ({1, 2}, {2, 1}, True), ("1", 1, False)])
def test_same_value_tells_types_apart(first, second, same):
    assert same_value(first, second) is same


@pytest.mark.parametrize(("aux_answer", "answer", "holds"), [
    ([3], 3, True), ((3, "x"), 3, True), ({"r": [1, 2]}, [1, 2], True), ("[1, 2]", [1, 2], True), (5, "5", True),
    ([2, 1], [1, 2], False), (4, 3, False), ([[1]], [1], True), (True, 1, False)])
def test_holds_answer_finds_main_s_answer_inside_aux_s(aux_answer, answer, holds):
    assert holds_answer(aux_answer, answer) is holds
