"""A program to run: model-written code plus the test snippets that grade it."""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

from teamrl.sandbox.asserts import rewrite_asserts


@dataclass(frozen=True)
class Program:
    """Model-written code, the tests that grade it and the trusted code the tests may use.

    Each test is a snippet of trusted Python that passes when it runs to the end without raising (a
    failed ``assert a == b`` reports both values, see ``teamrl.sandbox.asserts``). Typical tests are
    MBPP-style assert statements (``"assert add(1, 2) == 3"``) or one HumanEval assert wrapped by
    ``humaneval_tests``. A test never runs in the program's process: the names the program defines
    (its functions and classes, plain-data globals, imported modules) are available to the test, and
    calling one runs the call in a fresh process of the loaded program, whose result comes back as
    plain data (see ``teamrl.sandbox._harness``). So what a test checks is only what the program's
    functions return; arguments are copies (a function that mutates its argument in place is seen
    by its return value only).

    Attributes:
        code: the program. It runs as a module named ``__teamrl_program__``, so
            ``if __name__ == "__main__":`` blocks are skipped, once per test, in a fresh process.
        tests: the test snippets.
        setup: trusted code run on the test side before each test, never in the program's process:
            the problem's own imports and helper definitions that its tests call (HumanEval/32's
            ``poly``, HumanEval/38's ``encode_cyclic``). Its names take precedence over the
            program's, so a program cannot redefine the yardstick it is measured with. Whatever
            the program itself needs of it must also be in ``code``.
    """

    code: str
    tests: tuple[str, ...]
    setup: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.code, str):
            raise TypeError(f"Program.code must be a str, got {type(self.code).__name__}")
        if not isinstance(self.setup, str):
            raise TypeError(f"Program.setup must be a str, got {type(self.setup).__name__}")
        try:
            compile(self.setup, "<setup>", "exec")
        except SyntaxError as error:
            raise ValueError(f"Program.setup does not parse: {error}") from error
        if isinstance(self.tests, str):
            raise TypeError("Program.tests must be a sequence of test snippets, got a single str")
        object.__setattr__(self, "tests", tuple(self.tests))
        for index, test in enumerate(self.tests):
            if not isinstance(test, str) or not test.strip():
                raise ValueError(f"Program.tests[{index}] must be a non-empty str, got {test!r}")
            try:
                rewrite_asserts(test)
            except SyntaxError as error:
                raise ValueError(f"Program.tests[{index}] does not parse: {error}") from error


def _is_trivial_assert(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant)


def humaneval_tests(test_source: str, entry_point: str) -> tuple[str, ...]:
    """Split a HumanEval ``check(candidate)`` test into one snippet per assertion.

    Every top-level statement of ``check``'s body that contains an ``assert`` becomes a test; the
    other statements (imports, set-up assignments) are kept, in order, before each later test; asserts
    of a constant (``assert True, "..."``) test nothing and are dropped. Each snippet holds the module
    level of ``test_source`` (e.g. ``METADATA``, helpers), a ``check`` with the set-up and that one
    statement, and ``check(<entry_point>)``. So a failing assert no longer hides the ones after it,
    and the score is the fraction of assertions that hold.

    Raises:
        ValueError: ``test_source`` does not parse, has no ``check`` function with one parameter,
            or ``check`` asserts nothing; or ``entry_point`` is not an identifier.
    """
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    try:
        module = ast.parse(test_source)
    except SyntaxError as error:
        raise ValueError(f"HumanEval test source does not parse: {error}") from error
    checks = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1 or len(checks[0].args.args) != 1:
        raise ValueError("HumanEval test source must define exactly one `def check(candidate):`")
    check = checks[0]
    prelude = [node for node in module.body if node is not check]
    call = ast.Expr(ast.Call(func=ast.Name("check", ast.Load()), args=[ast.Name(entry_point, ast.Load())],
                             keywords=[]))
    setup: list[ast.stmt] = []
    tests = []
    for statement in check.body:
        if _is_trivial_assert(statement):
            continue
        if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
            function = copy.copy(check)
            function.body = [*setup, statement]
            snippet = ast.Module(body=[*prelude, function, call], type_ignores=[])
            tests.append(ast.unparse(ast.fix_missing_locations(snippet)))
        else:
            setup.append(statement)
    if not tests:
        raise ValueError("HumanEval check() contains no assert statement to test with")
    return tuple(tests)
