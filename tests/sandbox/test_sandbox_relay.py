"""What the cooperation measure stands on: calls a test makes recorded by the judge, direct calls, and a
relayed function whose calls the judge answers, the same code in every run (``Program.relay``)."""

from __future__ import annotations

import pytest

from teamrl.sandbox import Call, Program

CODE = """
import os


def aux(x, k=1):
    if x > 3:
        return aux(x - 1, k) + 1  # from within aux: runs as it is, not relayed
    return x * 2


def entry(xs):
    return sum(aux(x, k=3) for x in xs)


def view():
    return [getattr(aux, '__qualname__', ''), list(aux.__code__.co_names), sorted(globals())]
"""


def test_calls_of_the_recorded_function_are_reported_with_their_results(pool):
    record = pool.run([Program(CODE, ["assert entry([1, 2]) == 6", "assert entry([]) == 0 and entry([1]) == 2"],
                               record="entry")])[0]
    assert [outcome.passed for outcome in record.tests] == [True, True]
    first, second = (outcome.recorded_calls() for outcome in record.tests)
    assert [(call.args, call.kwargs, call.result) for call in first] == [(([1, 2],), {}, 6)]
    assert [(call.args, call.result) for call in second] == [(([],), 0), (([1],), 2)]


def test_results_that_are_not_plain_data_are_not_recorded(pool):
    code = "def entry(x):\n    return object()\n"
    outcome = pool.run([Program(code, ["entry(1)"], record="entry")])[0].tests[0]
    assert outcome.passed and outcome.recorded_calls() is None


def test_a_relayed_function_reports_its_callers_arguments_and_runs(pool):
    outcome = pool.run([Program(CODE, ["assert entry([2, 5]) == 4 + 8"], relay="aux", record="entry")])[0].tests[0]
    assert outcome.passed
    # aux(5) calls aux(4) and aux(3) itself: only main's two calls went through the relay
    assert [(call.args, call.kwargs) for call in outcome.relayed_calls()] == [((2,), {"k": 3}), ((5,), {"k": 3})]


def test_a_direct_call_gets_the_relay_values_in_turn_without_running_the_function(pool):
    code = CODE.replace("    return x * 2", "    os._exit(3)  # never runs here")
    record = pool.run([Program(code, [Call("entry", ([1, 2],), relay=[10, 20]), Call("entry", ([1, 2, 3],), relay=[1]),
                                      Call("aux", (3,)), Call("missing")], relay="aux")])[0]
    answered, short, alone, missing = record.tests
    assert answered.passed and answered.recorded_calls()[0].result == 30
    assert not short.passed and short.error_type == "RelayedCallUnanswered"
    assert [(call.args,) for call in short.relayed_calls()] == [((1,),), ((2,),)]
    assert alone.error_type == "NoResult"  # aux itself ran (called directly) and exited
    assert missing.error_type == "NameError" and "missing" in missing.message


def test_the_program_sees_the_same_relay_whatever_the_judge_answers(pool):
    """Nothing in the program's view tells a run where aux runs from one where the judge answers for it."""
    record = pool.run([Program(CODE, [Call("view"), Call("view", relay=[5]), Call("entry", ([1],), relay=[7])],
                               relay="aux")])[0]
    run, answered, swapped = (outcome.recorded_calls()[0].result for outcome in record.tests)
    assert run == answered and run[0] != "aux" and "aux" in run[2]
    assert swapped == 7


def test_direct_calls_take_plain_data_only():
    with pytest.raises(ValueError, match="Call.args must be plain data"):
        Call("entry", (object(),))
    with pytest.raises(ValueError, match="Call.relay must be plain data"):
        Call("entry", (1,), relay=[lambda: 1])
    with pytest.raises(ValueError, match="identifier"):
        Program("x = 1", ["assert x"], relay="not a name")
