"""Static feedback on agent-written code: syntax errors, undefined names, failed tests."""

import sys
import textwrap

import pytest

from teamrl.feedback.static import (
    StaticReport,
    SyntaxIssue,
    UndefinedName,
    analyze_code,
    check_syntax,
    find_undefined_names,
    format_test_failures,
)


def undefined(source: str, **kwargs) -> list[str]:
    return [finding.name for finding in find_undefined_names(textwrap.dedent(source), **kwargs)]


# ----------------------------------------------------------------------------------- syntax


def test_valid_code_has_no_syntax_issue():
    assert check_syntax("def f(x):\n    return x + 1\n") is None


def test_syntax_error_position_and_line():
    issue = check_syntax("def f(x):\n    return (x +\n")
    assert issue == SyntaxIssue("SyntaxError", "'(' was never closed", 2, 12, "    return (x +")
    assert issue.to_text() == (
        "SyntaxError at line 2, column 12: '(' was never closed\n    return (x +\n           ^"
    )


def test_indentation_error_kind():
    issue = check_syntax("def f():\nreturn 1\n")
    assert (issue.kind, issue.line, issue.text) == ("IndentationError", 2, "return 1")
    assert "expected an indented block" in issue.message


def test_column_counts_characters_not_bytes():
    issue = check_syntax("s = 'héé' + )\n")
    assert (issue.line, issue.column) == (1, 13)


@pytest.mark.parametrize(
    "source, message",
    [
        ("return 5\n", "'return' outside function"),
        ("def f():\n    nonlocal y\n", "no binding for nonlocal 'y' found"),
    ],
)
def test_compile_time_errors_beyond_the_parser_are_caught(source, message):
    issue = check_syntax(source)
    assert issue is not None and issue.message == message
    assert issue.text == source.splitlines()[issue.line - 1]


def test_nul_byte_is_reported_without_position():
    issue = check_syntax("x = '\0'\n")
    assert issue is not None and issue.kind == "SyntaxError" and "null bytes" in issue.message
    assert issue.to_text().startswith("SyntaxError: ")


def test_compile_warnings_are_not_errors():
    assert check_syntax("x = 1\nassert x is 1\ny = '\\d'\n") is None


# ------------------------------------------------------------------------ undefined: reported


def test_typo_in_function_body_is_reported_with_position():
    source = "def total(xs):\n    acc = 0\n    for x in xs:\n        acc += x\n    return acc_\n"
    assert find_undefined_names(source) == [UndefinedName("acc_", 5, 12)]


def test_each_name_reported_once_at_its_first_read():
    source = "def f():\n    return g()\n\nprint(g, h)\n"
    assert find_undefined_names(source) == [UndefinedName("g", 2, 12), UndefinedName("h", 4, 10)]


def test_column_of_undefined_name_counts_characters():
    assert find_undefined_names("s = 'é' + nope\n") == [UndefinedName("nope", 1, 11)]


def test_function_local_is_not_visible_at_module_level_or_in_other_functions():
    source = """
        def f():
            local = 1
            return local

        def g():
            return local

        print(local)
    """
    assert undefined(source) == ["local"]
    assert find_undefined_names(textwrap.dedent(source))[0].line == 7


def test_comprehension_variable_does_not_leak():
    assert undefined("squares = [i * i for i in range(3)]\nprint(i)\n") == ["i"]


def test_class_attribute_is_not_visible_from_methods():
    source = """
        class Counter:
            step = 2

            def bump(self, n):
                return n + step
    """
    assert undefined(source) == ["step"]


def test_class_attribute_is_not_visible_from_comprehension_conditions():
    source = """
        class Table:
            keys = [1, 2]
            doubled = [k * 2 for k in keys]
            kept = [k for k in range(5) if k in keys]
    """
    # The first iterable runs in the class body; the condition runs in the comprehension.
    findings = find_undefined_names(textwrap.dedent(source))
    assert [(f.name, f.line) for f in findings] == [("keys", 5)]


def test_exception_variable_is_local_to_its_function():
    source = """
        def parse(text):
            try:
                return int(text)
            except ValueError as error:
                return None

        def report():
            return str(error)
    """
    assert undefined(source) == ["error"]


def test_reads_in_defaults_decorators_and_bases_resolve_in_the_enclosing_scope():
    source = """
        def outer():
            @decorate
            def inner(x=default_value):
                return x

            class Child(Base):
                pass
            return inner, Child
    """
    assert undefined(source) == ["decorate", "default_value", "Base"]


def test_annotations_are_checked_unless_postponed():
    source = "def f(x: Widget) -> Gadget:\n    y: NotEvaluated = 1\n    return y\n"
    assert undefined(source) == ["Widget", "Gadget"]
    assert undefined("from __future__ import annotations\n" + source) == []


# -------------------------------------------------------------------- undefined: tricky but OK


OK_PROGRAMS = {
    "arguments of every kind": """
        def f(a, /, b, *args, c, d=1, **kwargs):
            return a, b, args, c, d, kwargs
        g = lambda x, *ys, z=2, **kw: (x, ys, z, kw)
    """,
    "comprehensions, nested and with conditions": """
        pairs = [(i, j) for i in range(3) for j in range(i) if i != j]
        table = {k: [v for v in range(k)] for k in range(4)}
        total = sum(x * y for x, y in pairs)
        uniq = {w for w in "abc" if w}
    """,
    "walrus in conditions and comprehensions": """
        def f(values):
            if (n := len(values)) > 3:
                return n
            hits = [y for x in values if (y := x * 2) > 1]
            return y, hits
        [last := v for v in range(3)]
        print(last)
    """,
    "global declared and bound in a function": """
        def setup():
            global CONFIG
            CONFIG = {"debug": True}

        def use():
            return CONFIG["debug"]
    """,
    "closures and nonlocal": """
        def counter():
            count = 0
            def bump():
                nonlocal count
                count += 1
                return count
            def peek():
                return count
            return bump, peek
    """,
    "recursion and functions used before their definition": """
        def main():
            return helper(3) + fact(3)

        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)

        def helper(n):
            return n
    """,
    "try/except as, with as, for targets, unpacking, del": """
        import json
        def load(path):
            try:
                with open(path) as fh, open(path) as (other):
                    data = json.load(fh)
            except (OSError, ValueError) as err:
                print(err)
                data = None
            for index, (key, *rest) in enumerate(data or []):
                print(index, key, rest)
            tmp = 1
            del tmp
            return data
    """,
    "imports of every form": """
        import os.path
        import collections.abc as cabc
        from typing import List as L, Optional
        from . import sibling
        def f() -> Optional[L[int]]:
            import re
            return os.path.join(cabc.__name__, sibling.x, re.escape("a"))
    """,
    "class bodies and methods": """
        class Shape:
            sides = 0
            names = [str(n) for n in range(sides)]
            label = __qualname__ + __module__

            def __init__(self, size):
                self.size = size

            def area(self):
                return Shape.sides * self.size

            def parent(self):
                return super().area(), __class__

            @staticmethod
            def make():
                return Shape(1)

            @property
            def double(self):
                return self.size * 2
    """,
    "builtins and module attributes": """
        print(len([1]), range(2), ValueError, __name__, __file__, __doc__)
        if __name__ == "__main__":
            raise SystemExit(0)
    """,
    "match captures": """
        def describe(point):
            match point:
                case {"x": x, **others}:
                    return x, others
                case [first, *tail] if tail:
                    return first, tail
                case Point(x=px) as whole:
                    return px, whole
                case _:
                    return None

        class Point:
            x = 0
    """,
    "a name bound on one path only": """
        import sys
        if sys.argv:
            mode = "cli"
        print(mode)
    """,
    "f-strings and augmented assignment": """
        count = 0
        count += 1
        print(f"{count:>{count}} {count!r}")
    """,
    "async functions": """
        import asyncio
        async def run(items):
            async with asyncio.timeout(1) as cm:
                async for item in items:
                    await asyncio.sleep(0, item)
            return cm
    """,
}


@pytest.mark.parametrize("source", OK_PROGRAMS.values(), ids=OK_PROGRAMS.keys())
def test_correct_scoping_is_not_reported(source):
    assert check_syntax(textwrap.dedent(source)) is None
    assert undefined(source) == []


def test_known_names_count_as_module_globals():
    main = "def solve(xs):\n    return aux(xs)\n"
    assert undefined(main) == ["aux"]
    assert undefined(main, known_names=["aux"]) == []


def test_star_import_silences_module_level_names_only():
    source = """
        from math import *
        print(sqrt(2))
        def f():
            return pi
    """
    assert undefined(source) == []


def test_global_declaration_reads_module_even_if_enclosing_function_binds():
    source = """
        def outer():
            value = 1
            def inner():
                global value
                return value
            return inner
    """
    assert undefined(source) == ["value"]


@pytest.mark.skipif(sys.version_info < (3, 12), reason="PEP 695 syntax")
def test_type_parameters_are_bound_for_their_definition_only():
    source = """
        def first[T](items: list[T]) -> T:
            return items[0]

        class Box[U]:
            Alias = int
            def get[V](self, a: Alias, b: U, c: V) -> U:
                return b, T

        type Pair[K] = tuple[K, K, Missing]
    """
    assert undefined(source) == ["T", "Missing"]


def test_undefined_names_need_parsable_source():
    with pytest.raises(SyntaxError):
        find_undefined_names("def f(:\n")


# ----------------------------------------------------------------------------------- report


def test_report_on_broken_code_has_only_the_syntax_error():
    report = analyze_code("print(undefined_name\n")
    assert not report.ok
    assert report.syntax_error is not None and report.undefined_names == ()
    assert report.to_text().startswith("SyntaxError at line 1")


def test_report_lists_undefined_names():
    report = analyze_code("def f():\n    return g(x)\n", known_names={"g"})
    assert report == StaticReport(undefined_names=(UndefinedName("x", 2, 14),))
    assert report.to_text() == "Undefined names:\n- line 2, column 14: name 'x' is not defined"


def test_clean_report():
    report = analyze_code("x = 1\n")
    assert report.ok
    assert report.to_text() == "No syntax errors or undefined names found."


# ------------------------------------------------------------------------------ test results


def record(test, passed, expected=None, actual=None, error=None):
    return {"test": test, "passed": passed, "expected": expected, "actual": actual, "error": error}


def test_failed_tests_show_expected_and_actual():
    results = [
        record("assert add(1, 2) == 3", True, "3", "3"),
        record("assert add(2, 2) == 4", False, "4", "5"),
        record("assert add(0, 0) == 0", False, error="TypeError: unsupported operand"),
    ]
    assert format_test_failures(results) == (
        "2 of 3 tests failed:\n"
        "- assert add(2, 2) == 4\n"
        "  expected: 4\n"
        "  actual:   5\n"
        "- assert add(0, 0) == 0\n"
        "  error:    TypeError: unsupported operand"
    )


def test_all_passed_and_nothing_run():
    assert format_test_failures([record("t1", True), record("t2", True)]) == "All 2 tests passed."
    assert format_test_failures([]) == "No tests were run."


def test_failures_beyond_the_limit_are_counted_not_listed():
    results = [record(f"test_{i}", False, "1", "2") for i in range(7)]
    text = format_test_failures(results, max_failures=2)
    assert text.startswith("7 of 7 tests failed:\n- test_0\n")
    assert "test_1" in text and "test_2" not in text
    assert text.endswith("... and 5 more failed tests")


def test_long_values_are_cut_keeping_the_end_of_errors():
    traceback = "Traceback (most recent call last):\n" + "  frame\n" * 100 + "ZeroDivisionError: x"
    results = [record("t", False, expected="a" * 50, actual="b" * 50, error=traceback)]
    text = format_test_failures(results, max_value_chars=20)
    assert "  expected: " + "a" * 20 + "... [30 more chars]" in text
    assert "  actual:   " + "b" * 20 + "... [30 more chars]" in text
    assert text.endswith("...ZeroDivisionError: x")


def test_missing_keys_and_unnamed_tests():
    assert format_test_failures([{"passed": False}]) == "1 of 1 tests failed:\n- <unnamed test>"


def test_positions_follow_python_line_breaks_only():
    # A form feed is whitespace to Python but a line break to str.splitlines().
    source = "x = 1\r\ny = '\x0c'\r\nprint(zz)\n"
    assert find_undefined_names(source) == [UndefinedName("zz", 3, 7)]
    assert check_syntax("a = 1\r\nb = (\x0c\n").text == "b = (\x0c"
