"""The sandbox's contract with benign programs: per-test outcomes, records, pool, configuration."""

from __future__ import annotations

import json
import logging
import time

import pytest

from teamrl.sandbox import (
    COMPLETED,
    ExecutionRecord,
    Program,
    SandboxLimits,
    SandboxPool,
    SandboxUnavailableError,
    _harness,
    find_bubblewrap,
    humaneval_tests,
    run_program,
)
from teamrl.sandbox import bubblewrap as bubblewrap_module
from teamrl.sandbox.asserts import COMPARE_MARKER, rewrite_asserts

ADD = "def add(a, b):\n    return a + b\n"


def test_each_test_reports_even_after_earlier_failures(pool):
    program = Program(ADD, ["assert add(1, 2) == 4", "assert add(2, 2) == 4", "add(None, 1)",
                            "assert 3 == add(1, 1)", "assert add(1, 1) in [5, 6], 'membership'"])
    record = pool.run([program])[0]
    assert record.status == COMPLETED and record.sandboxed
    assert [outcome.passed for outcome in record.tests] == [False, True, False, False, False]
    first, _, error, reversed_sides, membership = record.tests
    assert (first.error_type, first.actual, first.expected) == ("AssertionError", "3", "4")
    assert first.message == "expected 4, got 3" and first.phase == "test"
    assert error.error_type == "TypeError" and "NoneType" in error.message
    assert error.line == 2  # the line of the program where it was raised
    assert (reversed_sides.actual, reversed_sides.expected) == ("2", "3")  # the call side is "actual"
    assert membership.message == "'membership': 2 in [5, 6] is false"
    assert record.passed == 1 and record.total == 5 and not record.all_passed


def test_assert_rewrite_keeps_semantics_and_marker():
    assert _harness._COMPARE_MARKER == COMPARE_MARKER  # the driver recognises what the host writes
    rewritten = rewrite_asserts("order = []\nassert (order.append(1) or 1) == (order.append(2) or 1)\n"
                                "assert order == [1, 2]\nassert 1 < 2 < 3\nassert flag")
    assert rewritten.count("_teamrl_left = ") == 2  # the two single comparisons
    assert "assert 1 < 2 < 3" in rewritten and "assert flag" in rewritten  # left as they are
    namespace = {"flag": True}
    exec(rewritten, namespace)  # operands evaluated once each, left first
    with pytest.raises(AssertionError) as failure:
        exec(rewrite_asserts("assert len('ab') == 3, 'length'"), {})
    assert failure.value.args == (COMPARE_MARKER, 2, 3, "==", "length", True)


def test_program_failure_fails_every_test_with_its_cause(pool):
    broken, raising = pool.run([
        Program("def add(a, b):\n    return a +\n", ["assert add(1, 2) == 3", "assert True"]),
        Program(ADD + "raise RuntimeError('at import')\n", ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]),
    ])
    assert [(o.error_type, o.phase, o.line) for o in broken.tests] == [("SyntaxError", "program", 2)] * 2
    assert [(o.error_type, o.message, o.line) for o in raising.tests] == [("RuntimeError", "at import", 3)] * 2


def test_program_runs_as_a_module_not_main_and_its_output_is_kept(pool):
    code = ADD + "print('loaded')\nif __name__ == '__main__':\n    raise SystemExit('main block ran')\n"
    record = pool.run([Program(code, ["assert add(1, 1) == 2", "import sys; print('err', file=sys.stderr)"])])[0]
    assert record.all_passed
    assert record.stdout == "loaded\nloaded\n" and record.stderr == "err\n"


def test_tests_are_isolated_from_each_other(pool):
    code = "STATE = []\ndef push(x):\n    STATE.append(x)\n    return len(STATE)\n"
    record = pool.run([Program(code, ["assert push(1) == 1", "assert push(1) == 1"])])[0]
    assert record.all_passed  # each test sees a freshly loaded program


def test_record_is_json_serialisable_and_round_trips(pool):
    record = pool.run([Program(ADD, ["assert add(1, 2) == 3", "assert add(1, 2) == 0"])])[0]
    data = json.loads(json.dumps(record.to_dict()))
    assert ExecutionRecord.from_dict(data) == record
    assert data["tests"][1]["expected"] == "0" and data["status"] == "completed"


def test_pool_runs_programs_concurrently_and_keeps_order(pool):
    sleeper = "import time\ndef nap(x):\n    time.sleep(1.0)\n    return x\n"
    programs = [Program(sleeper, [f"assert nap({i}) == {i}"]) for i in range(2)]
    started = time.monotonic()
    records = pool.run(programs + [Program(ADD, ["assert add(1, 1) == 3"])])
    assert [record.passed for record in records] == [1, 1, 0]
    assert time.monotonic() - started < 2.0 + 1.0  # two 1 s programs side by side, not one after the other


def test_run_program_uses_default_limits(bubblewrap):
    record = run_program(Program(ADD, ["assert add(2, 3) == 5"]))
    assert record.all_passed and record.exit_code == 0


CHECK_SOURCE = (
    "METADATA = {}\n\n"
    "def check(candidate):\n"
    "    import math\n"
    "    assert candidate(1) == 2\n"
    "    assert True, 'no-op'\n"
    "    for x in range(3):\n"
    "        assert candidate(x) == x + 1\n"
)


def test_humaneval_tests_split_check_into_one_snippet_per_assert():
    tests = humaneval_tests(CHECK_SOURCE, "inc")
    assert len(tests) == 2
    for test in tests:
        assert "METADATA = {}" in test and "import math" in test and test.rstrip().endswith("check(inc)")
        assert "assert True" not in test
    assert "for x in range(3)" in tests[1] and "candidate(1)" not in tests[1]


def test_humaneval_snippets_grade_each_assert(pool):
    tests = humaneval_tests(CHECK_SOURCE, "inc")
    right, wrong = pool.run([Program("def inc(x):\n    return x + 1\n", tests),
                             Program("def inc(x):\n    return 2\n", tests)])
    assert right.all_passed
    assert [outcome.passed for outcome in wrong.tests] == [True, False]


@pytest.mark.parametrize(("source", "problem"), [
    ("def check(candidate):\n    pass\n", "no assert"),
    ("def helper(x):\n    assert x\n", "exactly one"),
    ("def check(candidate:\n", "does not parse"),
])
def test_humaneval_tests_rejects_bad_sources(source, problem):
    with pytest.raises(ValueError, match=problem):
        humaneval_tests(source, "f")


def test_program_and_limits_validate_their_input():
    with pytest.raises(TypeError, match="single str"):
        Program("x = 1", "assert x == 1")
    with pytest.raises(ValueError, match=r"tests\[1\] must be"):
        Program("x = 1", ["assert x == 1", "  "])
    with pytest.raises(ValueError, match=r"tests\[0\] does not parse"):
        Program("x = 1", ["assert x =="])
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=0)
    with pytest.raises(ValueError, match="program_timeout_s"):
        SandboxLimits(test_timeout_s=5, program_timeout_s=1)
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(workers=0)


def test_bwrap_command_isolates_everything(bubblewrap):
    args = bubblewrap_module.bwrap_command(bubblewrap, 1 << 20, bubblewrap_module.python_roots())
    joined = " ".join(args)
    assert "--die-with-parent" in args and "--new-session" in args
    assert "--unshare-net" in args or "--unshare-all" in args
    assert "--remount-ro /proc" in joined and "--tmpfs /tmp" in joined and "--chdir /tmp" in joined
    assert "--bind " not in joined  # nothing of the host is mounted writable
    if bubblewrap.privileged:
        assert "--unshare-pid" in args and "--cap-drop ALL" in joined


@pytest.fixture
def no_bubblewrap(monkeypatch):
    """Pretend bwrap is not on PATH (and forget the cached probe before and after)."""
    find_bubblewrap.cache_clear()
    monkeypatch.setattr(bubblewrap_module.shutil, "which", lambda name: None)
    yield
    find_bubblewrap.cache_clear()


def test_missing_bubblewrap_refuses_to_run_with_a_clear_error(no_bubblewrap):
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap.*allow_unsandboxed=True"):
        SandboxPool()
    with pytest.raises(SandboxUnavailableError, match="not found on PATH"):
        run_program(Program(ADD, ["assert add(1, 1) == 2"]))


def test_unsandboxed_mode_must_be_asked_for_and_warns(no_bubblewrap, caplog, monkeypatch):
    monkeypatch.setenv("TEAMRL_FAKE_SECRET", "hunter2")
    with caplog.at_level(logging.WARNING, logger="teamrl.sandbox"):
        with SandboxPool(workers=1, allow_unsandboxed=True) as weak_pool:
            record = weak_pool.run([Program(ADD, ["assert add(1, 1) == 2",
                                                  "import os; assert 'TEAMRL_FAKE_SECRET' not in os.environ"])])[0]
    assert not weak_pool.sandboxed and not record.sandboxed
    assert record.all_passed
    assert any("WITHOUT a sandbox" in message for message in caplog.messages)
