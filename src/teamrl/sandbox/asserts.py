"""Rewrite comparison asserts of test snippets so a failure reports its expected and actual values.

Done on the host (tests are trusted input, and the same snippet is graded for every sample of a
problem, so the rewrite is cached); the sandboxed driver only reads the values off the exception.
"""

from __future__ import annotations

import ast
import functools
import sys

#: First argument of the AssertionError a rewritten assert raises (the driver looks for it).
COMPARE_MARKER = "teamrl-compare"

_OPERATORS = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in",
}
_LEFT, _RIGHT = "_teamrl_left", "_teamrl_right"


def _contains_call(node: ast.AST) -> bool:
    return any(isinstance(item, ast.Call) for item in ast.walk(node))


def _load(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Load())


class _AssertRewriter(ast.NodeTransformer):
    """``assert a OP b, msg`` -> evaluate a, then b, then ``if not (a OP b): raise AssertionError(...)``.

    The comparison is the same Python expression on the same values, evaluated in the same order;
    only the failure carries more. Its ``raise`` looks ``AssertionError`` up by name, so a program
    that rebinds it still fails the test (with another exception) instead of passing it. Reported as
    *actual* is the left operand unless only the right one contains a call (``assert 3 == f(x)``).
    """

    def visit_Assert(self, node: ast.Assert) -> ast.AST | list[ast.stmt]:
        test = node.test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPERATORS):
            return node
        left, right = test.left, test.comparators[0]
        left_is_actual = _contains_call(left) or not _contains_call(right)
        failure = ast.Raise(exc=ast.Call(
            func=_load("AssertionError"),
            args=[ast.Constant(COMPARE_MARKER), _load(_LEFT), _load(_RIGHT),
                  ast.Constant(_OPERATORS[type(test.ops[0])]), node.msg or ast.Constant(None),
                  ast.Constant(left_is_actual)],
            keywords=[]))
        comparison = ast.Compare(left=_load(_LEFT), ops=test.ops, comparators=[_load(_RIGHT)])
        statements: list[ast.stmt] = [
            ast.Assign(targets=[ast.Name(id=_LEFT, ctx=ast.Store())], value=left),
            ast.Assign(targets=[ast.Name(id=_RIGHT, ctx=ast.Store())], value=right),
            ast.If(test=ast.UnaryOp(op=ast.Not(), operand=comparison), body=[failure], orelse=[]),
        ]
        return [ast.copy_location(statement, node) for statement in statements]


@functools.lru_cache(maxsize=4096)
def rewrite_asserts(source: str) -> str:
    """The test snippet with its single-comparison asserts rewritten (other code unchanged).

    Raises:
        SyntaxError: the snippet does not parse.
    """
    tree = _AssertRewriter().visit(ast.parse(source))
    return ast.unparse(ast.fix_missing_locations(tree))


@functools.lru_cache(maxsize=4096)
def standard_modules_read(source: str) -> tuple[str, ...]:
    """The top-level standard modules a test snippet reads attributes of without binding them itself
    (``math`` in ``assert math.isclose(f(x), 1.5)``), sorted.

    The judge gives the test its own import of each, whatever the program bound to the name: a test
    that relies on the program's ``import math`` must not be answered by a program's ``class math``.

    Raises:
        SyntaxError: the snippet does not parse.
    """
    tree = ast.parse(source)
    bound = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    read = {node.value.id for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and isinstance(node.value.ctx, ast.Load)}
    return tuple(sorted(name for name in read - bound if name in sys.stdlib_module_names))
