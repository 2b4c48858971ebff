"""A program to run: model-written code plus the test snippets that grade it."""

from __future__ import annotations

import ast
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from teamrl.sandbox._harness import encode
from teamrl.sandbox.asserts import rewrite_asserts


class _Run:
    def __repr__(self) -> str:
        return "RUN"


#: ``Call.relay`` default: the relayed function runs, as in every snippet test.
RUN = _Run()


def _refuse(value: object) -> None:
    raise TypeError(f"a {type(value).__name__} is not plain data")


def plain_data(value: Any, what: str) -> Any:
    """``value`` as the sandbox sends it (:func:`teamrl.sandbox._harness.encode`).

    Raises:
        ValueError: ``value`` is not plain data (None, bool, int, float, complex, str, bytes, and lists,
            tuples, sets and dicts of them), naming ``what``.
    """
    try:
        return encode(value, _refuse)
    except (TypeError, RecursionError) as error:
        raise ValueError(f"{what} must be plain data: {error}") from None


@dataclass(frozen=True)
class Call:
    """A test that calls one of the program's functions with given arguments; it passes when the call
    returns, and its outcome lists the call with its result (``TestOutcome.calls``).

    Attributes:
        function: the name of the program's function.
        args, kwargs: the arguments, plain data (None, bool, int, float, complex, str, bytes, and lists,
            tuples, sets and dicts of them).
        relay: what the program's relayed function (``Program.relay``) returns at its calls during this
            one, in turn, without running (a call beyond them raises); :data:`RUN` (default): it runs.
    """

    function: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    relay: Sequence[Any] | _Run = RUN

    def __post_init__(self) -> None:
        if not isinstance(self.function, str) or not self.function.isidentifier():
            raise ValueError(f"Call.function must be a Python identifier, got {self.function!r}")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        if not all(isinstance(name, str) for name in self.kwargs):
            raise ValueError("Call.kwargs must have str keys")
        self.payload()

    def payload(self) -> dict[str, Any]:
        """The test as the sandbox's driver reads it."""
        body = {"call": self.function, "args": plain_data(list(self.args), "Call.args"),
                "kwargs": [[name, plain_data(value, f"Call.kwargs[{name!r}]")] for name, value in self.kwargs.items()]}
        if self.relay is not RUN:
            body["relay"] = [plain_data(value, "Call.relay") for value in self.relay]
        return body


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
        tests: the test snippets, or :class:`Call` tests that call a function directly.
        setup: trusted code run on the test side before each test, never in the program's process:
            the problem's own imports and helper definitions that its tests call (HumanEval/32's
            ``poly``, HumanEval/38's ``encode_cyclic``). Its names take precedence over the
            program's, so a program cannot redefine the yardstick it is measured with. Whatever
            the program itself needs of it must also be in ``code``.
        relay: the name of a function of the program whose every call asks the test's judge what to
            do, once the program is loaded: run it, or (in a :class:`Call` test with a ``relay``
            value) return that value without running it. The same code stands in for it in every
            test, so nothing in the program's view but that value differs. None: no function is.
        record: the name of a function of the program whose calls by snippet tests are listed in
            their outcomes (``TestOutcome.calls``: arguments and result), or None.
    """

    code: str
    tests: tuple[str | Call, ...]
    setup: str = ""
    relay: str | None = None
    record: str | None = None

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
        for label, name in (("relay", self.relay), ("record", self.record)):
            if name is not None and not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(f"Program.{label} must be a Python identifier or None, got {name!r}")
        object.__setattr__(self, "tests", tuple(self.tests))
        for index, test in enumerate(self.tests):
            if isinstance(test, Call):
                continue
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
