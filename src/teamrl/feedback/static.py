"""Between-turn feedback on agent-written Python, found without running the code.

Three producers, all pure functions:

* :func:`check_syntax`: the first syntax error ``compile`` reports (it parses and builds symbol
  tables but executes nothing), with its line, column and the offending line;
* :func:`find_undefined_names`: names read somewhere but bound nowhere they would be visible from,
  following Python's scoping rules (see the function's docstring for what is and is not caught);
* :func:`format_test_failures`: concise text for the failed tests of a run (expected vs actual).

:func:`analyze_code` runs the first two and returns a :class:`StaticReport`; every finding has a
``to_text()`` giving the feedback an agent reads. Lines and columns are 1-based, as in Python's own
tracebacks and in editors, and columns count characters (not UTF-8 bytes).

The text is a model's and may be hostile. :func:`parse_code` is the one way model text is parsed
(here, in :mod:`teamrl.rewards.code_extract` and in the code reward): every way it can fail is a
:class:`SyntaxError` or an :class:`UnanalysableCode`, and text longer than :data:`MAX_SOURCE_CHARS`
or nested deeper than :data:`MAX_TREE_DEPTH` is refused before it can cost seconds, crash the
interpreter or exhaust the recursion limit of a walk over its tree. :func:`check_syntax` and
:func:`analyze_code` never raise on any ``str``: what stops the analysis is an
:class:`AnalysisFailure` they return.
"""

from __future__ import annotations

import ast
import builtins
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

#: Names every module can read without binding them: the builtins and the module attributes that
#: the import system sets (``__file__`` and friends are not in :mod:`builtins`).
MODULE_NAMES: frozenset[str] = frozenset(dir(builtins)) | {
    "__file__",
    "__builtins__",
    "__cached__",
    "__annotations__",
}
#: Names a class body can read because ``type`` puts them in its namespace before running it.
CLASS_BODY_NAMES: frozenset[str] = frozenset({"__module__", "__qualname__"})
#: The implicit cell of methods (what zero-argument ``super()`` uses).
METHOD_NAMES: frozenset[str] = frozenset({"__class__"})

#: Longest text parsed or compiled, in characters. CPython 3.11 takes superlinear time on some
#: constructs (compiling a call with 10,000 keyword arguments takes seconds, parsing an f-string with
#: 30,000 replacement fields too) and compiling a comprehension with ~40,000 ``for`` clauses overflows
#: the C stack (a segfault). Under this bound each parse or compile takes a fraction of a second (a
#: turn's feedback parses the same text several times) and nothing crashes, even with a raised
#: recursion limit. Completions are far shorter: the presets' 256 tokens are ~1,000 characters.
MAX_SOURCE_CHARS = 20_000
#: Deepest syntax tree analysed, in nodes from the module down. HumanEval's canonical solutions reach
#: 20; the bound keeps every recursive walk of a tree (``ast.NodeVisitor``, ``ast.unparse``,
#: ``copy.deepcopy``, the scope builder below) well within Python's default recursion limit.
MAX_TREE_DEPTH = 100

#: How many failed tests :func:`format_test_failures` details before summarising the rest.
DEFAULT_MAX_FAILURES = 5
#: How many characters of one value (a test, expected, actual, error) it shows.
DEFAULT_MAX_VALUE_CHARS = 300


@dataclass(frozen=True)
class SyntaxIssue:
    """The syntax error that stops the code from compiling.

    ``kind`` is the exception's class name (``SyntaxError``, ``IndentationError``, ``TabError``);
    ``line`` and ``column`` are 1-based and None when Python gives no position; ``text`` is the
    offending source line without its line break ("" when unknown).
    """

    kind: str
    message: str
    line: int | None
    column: int | None
    text: str

    def to_text(self) -> str:
        """``"<kind> at line L, column C: <message>"``, then the offending line and a caret."""
        where = ""
        if self.line is not None:
            where = f" at line {self.line}" + (f", column {self.column}" if self.column else "")
        lines = [f"{self.kind}{where}: {self.message}"]
        code = self.text.strip()
        if code:
            lines.append(f"    {code}")
            indent = len(self.text) - len(self.text.lstrip())
            if self.column and self.column - 1 >= indent:
                lines.append("    " + " " * (self.column - 1 - indent) + "^")
        return "\n".join(lines)


@dataclass(frozen=True)
class UndefinedName:
    """A name read at ``line``/``column`` (1-based, its first such read) that nothing binds."""

    name: str
    line: int
    column: int

    def to_text(self) -> str:
        """``"line L, column C: name 'x' is not defined"``."""
        return f"line {self.line}, column {self.column}: name '{self.name}' is not defined"


@dataclass(frozen=True)
class AnalysisFailure:
    """Why code was not analysed at all.

    ``kind`` is the exception Python's parser or compiler raised on it other than a syntax error
    (``RecursionError``, ``MemoryError``: nested too deeply for them), or ``TooLong`` / ``TooDeep``
    for code beyond :data:`MAX_SOURCE_CHARS` / :data:`MAX_TREE_DEPTH`; ``detail`` says more.
    """

    kind: str
    detail: str

    def to_text(self) -> str:
        """``"The code could not be analysed: <kind> (<detail>)."``"""
        return f"The code could not be analysed: {self.kind} ({self.detail})."


class UnanalysableCode(ValueError):
    """Raised by :func:`parse_code` (and so :func:`find_undefined_names`) for code it does not analyse."""

    def __init__(self, failure: AnalysisFailure) -> None:
        super().__init__(failure.to_text())
        self.failure = failure


@dataclass(frozen=True)
class StaticReport:
    """What static analysis found in one piece of code.

    ``failure`` is why the code was not analysed (then nothing else is set); ``syntax_error`` is None
    when the code compiles; ``undefined_names`` is empty when it does not (an unparsable program has
    no scopes to analyse).
    """

    syntax_error: SyntaxIssue | None = None
    undefined_names: tuple[UndefinedName, ...] = field(default_factory=tuple)
    failure: AnalysisFailure | None = None

    @property
    def ok(self) -> bool:
        """True when the code was analysed and nothing was found."""
        return self.failure is None and self.syntax_error is None and not self.undefined_names

    def to_text(self) -> str:
        """The findings as feedback text, one per line; a one-line all-clear when there are none."""
        if self.failure is not None:
            return self.failure.to_text()
        if self.syntax_error is not None:
            return self.syntax_error.to_text()
        if not self.undefined_names:
            return "No syntax errors or undefined names found."
        return "Undefined names:\n" + "\n".join(
            f"- {finding.to_text()}" for finding in self.undefined_names
        )


_NESTED = "nested too deeply for Python's parser and compiler"


def _length_failure(source: str) -> AnalysisFailure | None:
    if len(source) <= MAX_SOURCE_CHARS:
        return None
    return AnalysisFailure("TooLong", f"{len(source):,} characters; code longer than {MAX_SOURCE_CHARS:,} "
                                      "is not analysed")


def _too_deep(tree: ast.AST) -> bool:
    # Level by level, not recursively: a recursive walk is what the bound protects, and would fail on
    # the trees it refuses. Reading _fields directly is ~4x faster than ast.iter_child_nodes, and this
    # runs on every parse.
    level = [tree]
    for _ in range(MAX_TREE_DEPTH):
        children = []
        for node in level:
            for name in node._fields:
                value = getattr(node, name, None)
                if isinstance(value, list):
                    children.extend(value)
                elif isinstance(value, ast.AST):
                    children.append(value)
        level = [child for child in children if isinstance(child, ast.AST)]
        if not level:
            return False
    return True


def parse_code(source: str) -> ast.Module:
    """``ast.parse(source)`` for model-written text, failing only in the two ways documented here.

    Raises:
        SyntaxError: ``source`` does not parse; also for a NUL byte or a lone surrogate, which
            Python 3.11 reports as ValueError (no source file can hold them).
        UnanalysableCode: ``source`` is longer than :data:`MAX_SOURCE_CHARS`, its tree is deeper than
            :data:`MAX_TREE_DEPTH`, or the parser gave up on its nesting (RecursionError, MemoryError).
    """
    too_long = _length_failure(source)
    if too_long is not None:
        raise UnanalysableCode(too_long)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except ValueError as error:  # includes UnicodeEncodeError
        raise SyntaxError(str(error)) from None
    except (RecursionError, MemoryError) as error:
        raise UnanalysableCode(AnalysisFailure(type(error).__name__, _NESTED)) from None
    if _too_deep(tree):
        raise UnanalysableCode(AnalysisFailure(
            "TooDeep", f"its syntax tree is more than {MAX_TREE_DEPTH} levels deep"))
    return tree


def check_syntax(source: str, filename: str = "<agent>") -> SyntaxIssue | AnalysisFailure | None:
    """The first error ``compile(source, filename, "exec")`` raises, or None when it compiles.

    Compiling (not just ``ast.parse``) also catches errors found while building symbol tables:
    ``'return' outside function``, ``no binding for nonlocal 'x' found``, ``'await' outside async
    function``... Nothing is executed, and compile-time warnings are silenced. Code longer than
    :data:`MAX_SOURCE_CHARS` is not compiled, and code nested too deeply for the compiler is not
    a syntax error: both give an :class:`AnalysisFailure`.
    """
    too_long = _length_failure(source)
    if too_long is not None:
        return too_long
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as error:
        return SyntaxIssue(
            kind=type(error).__name__,
            message=error.msg,
            line=error.lineno,
            column=error.offset if error.lineno is not None else None,
            text=_source_line(source, error.lineno, fallback=error.text or ""),
        )
    except ValueError as error:
        # Python 3.11 reports NUL bytes in the source as ValueError, 3.12 as SyntaxError; a lone
        # surrogate (UnicodeEncodeError) cannot be in a source file either.
        return SyntaxIssue(kind="SyntaxError", message=str(error), line=None, column=None, text="")
    except (RecursionError, MemoryError) as error:
        return AnalysisFailure(type(error).__name__, _NESTED)
    return None


def source_lines(source: str) -> list[str]:
    """``source``'s lines as Python numbers them (what ``lineno`` in its AST and errors counts)."""
    # Python's line breaks only: str.splitlines() also splits on form feeds, U+2028 and others,
    # which would shift line numbers.
    return re.split(r"\r\n?|\n", source)


def _source_line(source: str, lineno: int | None, fallback: str) -> str:
    lines = source_lines(source)
    if lineno is not None and 1 <= lineno <= len(lines):
        return lines[lineno - 1]
    return fallback.rstrip("\r\n")


# --------------------------------------------------------------------------------------------
# Undefined names: one pass collects each scope's bindings, declarations and reads; resolution
# runs afterwards, so the order of definitions in the source does not matter (a function may call
# one defined below it).
# --------------------------------------------------------------------------------------------

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
#: ``type X[T] = ...`` (Python 3.12+); an empty tuple, which matches nothing, before that.
_TYPE_ALIAS: type | tuple[()] = getattr(ast, "TypeAlias", ())


@dataclass(eq=False)
class _Scope:
    # "module", "function", "class", "comprehension", or "annotation" (PEP 695 type parameters)
    kind: str
    parent: _Scope | None
    bound: set[str] = field(default_factory=set)
    declared_global: set[str] = field(default_factory=set)
    declared_nonlocal: set[str] = field(default_factory=set)
    stores: list[str] = field(default_factory=list)
    reads: list[ast.Name] = field(default_factory=list)


class _ScopeBuilder:
    """Walks a module's AST, assigning every binding and read to the scope Python would use."""

    def __init__(self, tree: ast.Module) -> None:
        self.module = _Scope("module", None)
        self.scopes = [self.module]
        self.star_import = False
        self.lazy_annotations = any(
            isinstance(node, ast.ImportFrom)
            and node.module == "__future__"
            and any(alias.name == "annotations" for alias in node.names)
            for node in tree.body
        )
        self._visit_all(tree.body, self.module)

    def _child(self, kind: str, parent: _Scope) -> _Scope:
        scope = _Scope(kind, parent)
        self.scopes.append(scope)
        return scope

    def _visit_all(self, nodes: Iterable[ast.AST | None], scope: _Scope) -> None:
        for node in nodes:
            if node is not None:
                self._visit(node, scope)

    def _annotation(self, node: ast.expr | None, scope: _Scope) -> None:
        # With ``from __future__ import annotations`` annotations are strings, never evaluated.
        if node is not None and not self.lazy_annotations:
            self._visit(node, scope)

    def _visit(self, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                scope.reads.append(node)
            else:
                scope.stores.append(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self._function(node, scope)
        elif isinstance(node, ast.ClassDef):
            self._class(node, scope)
        elif isinstance(node, _COMPREHENSIONS):
            self._comprehension(node, scope)
        elif isinstance(node, ast.NamedExpr):
            # PEP 572: a walrus inside a comprehension binds in the enclosing function or module.
            target_scope = scope
            while target_scope.kind == "comprehension" and target_scope.parent is not None:
                target_scope = target_scope.parent
            target_scope.stores.append(node.target.id)
            self._visit(node.value, scope)
        elif isinstance(node, ast.Global):
            scope.declared_global.update(node.names)
        elif isinstance(node, ast.Nonlocal):
            scope.declared_nonlocal.update(node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    self.star_import = True
                else:
                    # ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c``.
                    scope.stores.append(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler):
            if node.name:
                scope.stores.append(node.name)
            self._visit_all(ast.iter_child_nodes(node), scope)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)):
            if node.name:
                scope.stores.append(node.name)
            self._visit_all(ast.iter_child_nodes(node), scope)
        elif isinstance(node, ast.MatchMapping):
            if node.rest:
                scope.stores.append(node.rest)
            self._visit_all(ast.iter_child_nodes(node), scope)
        elif isinstance(node, _TYPE_ALIAS):
            self._visit(node.name, scope)
            self._visit(node.value, self._type_param_scope(node, scope))
        elif isinstance(node, ast.AnnAssign):
            # A local variable's annotation inside a function is never evaluated.
            if scope.kind != "function":
                self._annotation(node.annotation, scope)
            self._visit_all((node.target, node.value), scope)
        else:
            self._visit_all(ast.iter_child_nodes(node), scope)

    def _function(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, scope: _Scope
    ) -> None:
        args = node.args
        # Decorators and defaults are evaluated where the function is defined, annotations there
        # too unless type parameters give them a scope of their own.
        self._visit_all(args.defaults, scope)
        self._visit_all(args.kw_defaults, scope)
        all_args = [*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg]
        present = [arg for arg in all_args if arg is not None]
        header = self._type_param_scope(node, scope)
        if isinstance(node, ast.Lambda):
            body: list[ast.AST] = [node.body]
        else:
            self._visit_all(node.decorator_list, scope)
            for arg in present:
                self._annotation(arg.annotation, header)
            self._annotation(node.returns, header)
            scope.stores.append(node.name)
            body = list(node.body)
        inner = self._child("function", header)
        inner.stores.extend(arg.arg for arg in present)
        self._visit_all(body, inner)

    def _class(self, node: ast.ClassDef, scope: _Scope) -> None:
        self._visit_all(node.decorator_list, scope)
        header = self._type_param_scope(node, scope)
        self._visit_all(node.bases, header)
        self._visit_all(node.keywords, header)
        scope.stores.append(node.name)
        self._visit_all(node.body, self._child("class", header))

    def _type_param_scope(self, node: ast.AST, scope: _Scope) -> _Scope:
        # PEP 695 (Python 3.12+): ``def f[T]`` / ``class C[T]`` bind T in a scope of their own that
        # the body sees. Older Pythons have no ``type_params``.
        type_params = getattr(node, "type_params", None)
        if not type_params:
            return scope
        params = self._child("annotation", scope)
        params.stores.extend(param.name for param in type_params)
        return params

    def _comprehension(self, node: ast.expr, scope: _Scope) -> None:
        generators = node.generators
        # The first iterable is evaluated in the enclosing scope, everything else inside.
        self._visit(generators[0].iter, scope)
        inner = self._child("comprehension", scope)
        for index, generator in enumerate(generators):
            self._visit(generator.target, inner)
            if index:
                self._visit(generator.iter, inner)
            self._visit_all(generator.ifs, inner)
        if isinstance(node, ast.DictComp):
            self._visit_all((node.key, node.value), inner)
        else:
            self._visit(node.elt, inner)


def _bind(scopes: list[_Scope], module: _Scope) -> None:
    # Declarations apply to the whole scope, wherever they appear, so stores are placed only now.
    for scope in scopes:
        for name in scope.stores:
            if name in scope.declared_global:
                module.bound.add(name)
            elif name not in scope.declared_nonlocal:
                scope.bound.add(name)


def _is_defined(name: str, scope: _Scope, module_defined: frozenset[str] | None) -> bool:
    # module_defined None means "anything may be global" (after ``from x import *``).
    def in_module() -> bool:
        return module_defined is None or name in module_defined

    if name in scope.declared_global:
        return in_module()
    if name in scope.bound or (scope.kind == "class" and name in CLASS_BODY_NAMES):
        return True
    inner, current = scope, scope.parent
    while current is not None:
        if current.kind == "module":
            return in_module()
        if current.kind == "class":
            # A class body is not an enclosing scope for the functions and comprehensions inside
            # it; only PEP 695 annotation scopes see it, and methods see its ``__class__`` cell.
            if inner.kind == "annotation" and name in current.bound:
                return True
            if scope.kind == "function" and name in METHOD_NAMES:
                return True
        elif name in current.declared_global:
            return in_module()
        elif name in current.bound:
            return True
        inner, current = current, current.parent
    return in_module()


def find_undefined_names(source: str, known_names: Iterable[str] = ()) -> list[UndefinedName]:
    """Names read in ``source`` that no scope they could come from binds, first read of each.

    A read resolves, as in Python, to the innermost function/lambda/comprehension scope that binds
    the name, skipping class bodies (except the class body reading its own names), then to the
    module, then to builtins; ``global``/``nonlocal`` declarations are honoured. Bindings are
    assignments (including augmented, annotated, starred and unpacking targets, ``for``,
    ``with ... as``, ``del``), ``def``/``class``, parameters, imports, ``except ... as``, walrus
    targets (in the enclosing non-comprehension scope), ``match`` captures and PEP 695 type
    parameters.
    ``known_names`` are treated as module globals (e.g. the other agent's functions).

    There is no flow analysis, so code that binds a name on some path is never reported for it: a
    name bound anywhere in a visible scope counts as defined, even where the read comes first. After
    ``from m import *`` no module-level name is reported. Names made at run time (``globals()[...] = ``,
    ``exec``) are not seen. Findings are sorted by position.
    Raises what :func:`parse_code` raises: ``SyntaxError`` when ``source`` does not parse,
    :class:`UnanalysableCode` when it is too long or too deeply nested to analyse.
    """
    tree = parse_code(source)
    builder = _ScopeBuilder(tree)
    _bind(builder.scopes, builder.module)
    module_defined = (
        None
        if builder.star_import
        else frozenset(builder.module.bound) | MODULE_NAMES | frozenset(known_names)
    )
    lines = source_lines(source)
    first_reads: dict[str, ast.Name] = {}
    for scope in builder.scopes:
        for read in scope.reads:
            if not _is_defined(read.id, scope, module_defined):
                current = first_reads.get(read.id)
                if current is None or _position(read) < _position(current):
                    first_reads[read.id] = read
    findings = [
        UndefinedName(name, read.lineno, _char_column(lines, read.lineno, read.col_offset))
        for name, read in first_reads.items()
    ]
    return sorted(findings, key=lambda finding: (finding.line, finding.column, finding.name))


def _position(node: ast.expr) -> tuple[int, int]:
    return node.lineno, node.col_offset


def _char_column(lines: list[str], lineno: int, byte_offset: int) -> int:
    # ast column offsets count UTF-8 bytes; people count characters.
    line = lines[lineno - 1] if 1 <= lineno <= len(lines) else ""
    return len(line.encode("utf-8")[:byte_offset].decode("utf-8", errors="replace")) + 1


def analyze_code(source: str, known_names: Iterable[str] = ()) -> StaticReport:
    """:func:`check_syntax`, then (only if it compiles) :func:`find_undefined_names`; never raises.

    Code that cannot be analysed (too long, or nested too deeply for Python's compiler or for
    :data:`MAX_TREE_DEPTH`) gives a report with only its ``failure``.
    """
    issue = check_syntax(source)
    if isinstance(issue, AnalysisFailure):
        return StaticReport(failure=issue)
    if issue is not None:
        return StaticReport(syntax_error=issue)
    try:
        names = find_undefined_names(source, known_names)
    except UnanalysableCode as error:
        return StaticReport(failure=error.failure)
    return StaticReport(undefined_names=tuple(names))


# --------------------------------------------------------------------------------------------
# Test results
# --------------------------------------------------------------------------------------------


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more chars]"


def _tail(text: str, limit: int) -> str:
    # The end of an error (a traceback's last line) says the most.
    return text if len(text) <= limit else f"[{len(text) - limit} chars before] ...{text[-limit:]}"


def _failure_lines(record: Mapping[str, object], limit: int) -> Iterator[str]:
    yield "- " + _head(str(record.get("test") or "<unnamed test>").strip(), limit)
    expected, actual, error = record.get("expected"), record.get("actual"), record.get("error")
    if expected is not None:
        yield "  expected: " + _head(str(expected), limit)
    if actual is not None:
        yield "  actual:   " + _head(str(actual), limit)
    if error is not None:
        yield "  error:    " + _tail(str(error).strip(), limit)


def format_test_failures(
    results: Iterable[Mapping[str, object]],
    max_failures: int = DEFAULT_MAX_FAILURES,
    max_value_chars: int = DEFAULT_MAX_VALUE_CHARS,
) -> str:
    """Feedback text for the failed records among ``results``.

    Each record is ``{"test": str, "passed": bool, "expected": str | None, "actual": str | None,
    "error": str | None}`` (missing keys read as None; a record is failed unless ``passed`` is
    true). The text opens with ``"F of N tests failed:"`` and details the first ``max_failures``
    failures in order: the test, then ``expected:``/``actual:``/``error:`` lines for the values
    that are not None. Each value is cut to ``max_value_chars`` characters, keeping the start of
    tests and values and the end of errors. Further failures are summarised as ``"... and M more
    failed tests"``. With no failure it is ``"All N tests passed."``, with no record
    ``"No tests were run."``.
    """
    records = list(results)
    failed = [record for record in records if not record.get("passed")]
    if not records:
        return "No tests were run."
    if not failed:
        return f"All {len(records)} tests passed."
    lines = [f"{len(failed)} of {len(records)} tests failed:"]
    for record in failed[:max_failures]:
        lines.extend(_failure_lines(record, max_value_chars))
    if len(failed) > max_failures:
        lines.append(f"... and {len(failed) - max_failures} more failed tests")
    return "\n".join(lines)
