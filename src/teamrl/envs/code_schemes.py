"""Recognise how the helper (``aux``) and the main agent cooperated, from their code alone.

The MAGRPO paper names four cooperation schemes that emerge in the coding task. Each is recognised
here by rules on the AST of main's entry-point function (extracted from the completions with
``teamrl.rewards.code_extract.extract_code``, as the reward does); nothing is executed.

Words used below:

- *aux call*: a call ``aux(...)`` anywhere in main (nested scopes included).
- *aux's result*: an aux call, or a load of a name bound (``=``, annotated or augmented
  assignment, ``:=``, ``for`` target, comprehension target, ``with ... as``) from a value that
  contains an aux call or another name holding aux's result (followed to a fixed point). A load
  counts only after the binding in source order (inside the loop body for ``for``, inside the
  comprehension for its targets), so ``s = aux(s)`` does not make the ``s`` passed to aux a result.
- *depends on aux*: contains aux's name or aux's result.
- *in a test*: inside the condition of an ``if``, ``while``, ternary or comprehension filter.
- *used as a value*: aux's result (or aux itself, handed to a call) that is not in a test, does not
  merely flow into a binding, and is not a bare expression statement (a result thrown away).
- *returned as the answer*: a ``return`` whose value is aux's result, or has it as a branch of a
  ternary or an operand of ``and``/``or``.
- *recomputes*: a branch that does not depend on aux, reads one of main's parameters and computes
  something from them (a call, an operator, a subscript, an attribute, a loop or a comprehension),
  ``raise`` statements aside.

Rules, checked in this priority order (a joint action can match several; the first wins):

1. ``trivial``: no cooperation to speak of: main's entry point is missing or does not parse; aux is
   missing, not a function, does not parse or is empty (after a docstring, only ``pass``, ``...``,
   constants, ``return``/``return None`` or ``raise NotImplementedError``); main never calls aux
   (``teamrl.rewards.code.calls_function``); or main is a thin wrapper of aux
   (``teamrl.rewards.code.is_thin_wrapper``).
2. ``fallback``: main has its own path for when aux fails: (a) a ``try`` whose body mentions aux,
   with an ``except`` handler that does more than ``pass``, ``...``, ``raise``, ``continue``,
   ``break`` or ``return None``; or (b) main returns aux's result as the answer, and a conditional
   on aux's result (an ``if``/ternary whose test depends on aux, or an ``or`` with an aux-dependent
   operand before the last) has a branch that recomputes.
   The branches of an ``if`` are its body, its ``else`` and, when the body ends in ``return`` or
   ``raise`` and there is no ``else``, the statements after it; of a ternary its two values; of an
   ``or`` its last operand.
3. ``coordinator``: main splits the work and calls aux on the parts: (a) an aux call in the body of
   a ``for``/``while`` loop, in a comprehension (other than its first iterable) or in a lambda;
   (b) aux handed to a call (``map(aux, parts)``, ``sorted(xs, key=aux)``); or (c) two aux calls
   with different arguments (``aux(left) + aux(right)``).
4. ``strategy_filter``: aux decides a branch: aux's result is in the test of an ``if``, ``while``
   or ternary, and is used as a value nowhere.
5. ``decorator``: aux does the core and main handles edge cases or formatting around it:
   (a) a guard clause: a top-level ``if`` (or one of its ``elif``) of main, not after its first
   statement that mentions aux, whose test does not mention aux and whose body ends in
   ``return``/``raise`` without mentioning aux (``if not xs: return []``); (b) post-processing:
   aux's result is part of a larger expression (an operand, a call argument, an iterable, a
   subscript, an attribute, an f-string, ...) outside tests;
   (c) an edge-case check: a test depends on aux's result and that result is also used as a value.
6. ``other``: main calls aux but none of the rules above match (e.g. ``return aux(sorted(xs))``,
   or aux's result thrown away).

Why this order: ``trivial`` first, as patterns around an empty or unused helper mean nothing;
then from the most specific to the most generic evidence. A fallback path is an explicit
redundancy that no other scheme has; calling aux on several parts is a structural fact that
conditions or post-processing inside the loop do not change; a pure decision by aux is narrower than
the catch-all of code around aux's result that defines a decorator.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from teamrl.rewards.code import calls_function, is_thin_wrapper
from teamrl.rewards.code_extract import Definition, extract_code

SCHEMES = ("trivial", "fallback", "coordinator", "strategy_filter", "decorator", "other")
"""The schemes, in the priority order of the rules."""

_TRY = (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())  # ``except*`` is Python 3.11+
_SKIPS = (ast.Raise, ast.Continue, ast.Break)  # an except handler doing only these computes nothing
_CONDITIONALS = (ast.If, ast.While, ast.IfExp)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_COMPUTATION = (ast.Call, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Subscript, ast.Attribute,
                ast.JoinedStr, ast.For, ast.While) + _COMPREHENSIONS
_BINDING_VALUES = {(ast.Assign, "value"), (ast.AnnAssign, "value"), (ast.AugAssign, "value"),
                   (ast.NamedExpr, "value"), (ast.For, "iter"), (ast.AsyncFor, "iter"),
                   (ast.comprehension, "iter"), (ast.withitem, "context_expr")}
_REPEATED = {(ast.For, "body"), (ast.AsyncFor, "body"), (ast.While, "body"), (ast.ListComp, "elt"),
             (ast.SetComp, "elt"), (ast.GeneratorExp, "elt"), (ast.DictComp, "key"), (ast.DictComp, "value"),
             (ast.comprehension, "ifs"), (ast.Lambda, "body")}

Position = tuple[int, int]


@dataclass(frozen=True)
class SchemeResult:
    """How one joint action cooperated.

    Attributes:
        scheme: one of ``SCHEMES``, the first (by priority) whose rules matched.
        matched: every scheme whose rules matched, in priority order (``scheme`` first).
        reasons: ``"<scheme>: <rule that matched, with main's line>"`` for each match, in priority
            order; line numbers count from the first line of main's definition.
    """

    scheme: str
    reasons: tuple[str, ...]
    matched: tuple[str, ...]


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _start(node: ast.AST) -> Position:
    return node.lineno, node.col_offset


def _end(node: ast.AST) -> Position:
    return node.end_lineno, node.end_col_offset


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def _does_nothing(statement: ast.stmt) -> bool:
    """``pass``, a constant expression (``...``), ``return``/``return None``, ``raise NotImplementedError``."""
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Constant)
    if isinstance(statement, ast.Return):
        return statement.value is None or (isinstance(statement.value, ast.Constant)
                                           and statement.value.value is None)
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        raised = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
        return _is_name(raised, "NotImplementedError")
    return False


def _is_empty(function: ast.AST) -> bool:
    """Whether a function's body, after its docstring, does nothing (see ``_does_nothing``)."""
    return all(_does_nothing(statement) for statement in _without_docstring(function.body))


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    named = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return {arg.arg for arg in named}


def _binding_sites(function: ast.AST) -> Iterator[tuple[ast.AST, ast.AST, Position, Position]]:
    """(target, value, from, to) of every binding in ``function``: ``target`` holds data derived
    from ``value`` for loads between the positions ``from`` and ``to``."""
    end = _end(function)
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            yield from ((target, node.value, _end(node), end) for target in node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            yield node.target, node.value, _end(node), end
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            yield node.target, node.iter, _start(node.body[0]), end
        elif isinstance(node, _COMPREHENSIONS):
            yield from ((generator.target, generator.iter, _start(node), _end(node))
                        for generator in node.generators)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from ((item.optional_vars, item.context_expr, _start(node.body[0]), end)
                        for item in node.items if item.optional_vars is not None)


class _Main:
    """Main's function with what the rules ask of it: parents of nodes and where aux's result is."""

    def __init__(self, function: ast.FunctionDef | ast.AsyncFunctionDef, aux_name: str) -> None:
        self.function, self.aux_name = function, aux_name
        self.parameters = _parameters(function)
        self.parents: dict[ast.AST, tuple[ast.AST, str]] = {}
        for node in ast.walk(function):
            for field, value in ast.iter_fields(node):
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        self.parents[child] = (node, field)
        self.results: set[tuple[str, Position, Position]] = set()
        sites = list(_binding_sites(function))
        grown = True
        while grown:  # a name bound from aux's result holds aux's result too: follow to a fixed point
            before = len(self.results)
            for target, value, start, stop in sites:
                if self.depends(value):
                    self.results.update((name.id, start, stop) for name in ast.walk(target)
                                        if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store))
            grown = len(self.results) > before
        nodes = list(ast.walk(function))
        self.calls = [node for node in nodes if isinstance(node, ast.Call) and _is_name(node.func, aux_name)]
        self.handed = [node for node in nodes if _is_name(node, aux_name) and self.receiving_call(node) is not None]
        self.loads = [node for node in nodes if self.is_result_load(node)]

    def receiving_call(self, node: ast.AST) -> ast.Call | None:
        """The call that ``node`` is handed to as an argument (positional, ``*``, keyword), or None."""
        parent, field = self.parents[node]
        if isinstance(parent, ast.Starred):
            parent, field = self.parents[parent]
        if isinstance(parent, ast.keyword):
            parent, field = self.parents[parent][0], "keywords"
        return parent if isinstance(parent, ast.Call) and field != "func" else None

    def is_result_load(self, node: ast.AST) -> bool:
        """Whether ``node`` reads a name that holds aux's result at that point."""
        return isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and any(
            name == node.id and start <= _start(node) <= stop for name, start, stop in self.results)

    def depends(self, *nodes: ast.AST) -> bool:
        """Whether any of ``nodes`` mentions aux or reads aux's result."""
        return any(_is_name(item, self.aux_name) or self.is_result_load(item)
                   for node in nodes for item in ast.walk(node))

    def mentions_aux(self, node: ast.AST) -> bool:
        return any(_is_name(item, self.aux_name) for item in ast.walk(node))

    def ancestors(self, node: ast.AST, within_statement: bool = False) -> Iterator[tuple[ast.AST, str]]:
        """(parent, field) pairs from ``node`` up to main (or up to its enclosing statement)."""
        while node in self.parents:
            node, field = self.parents[node]
            yield node, field
            if within_statement and isinstance(node, ast.stmt):
                return

    def in_test(self, node: ast.AST) -> bool:
        return any((isinstance(parent, _CONDITIONALS) and field == "test")
                   or (isinstance(parent, ast.comprehension) and field == "ifs")
                   for parent, field in self.ancestors(node, within_statement=True))

    def used_as_value(self, node: ast.AST) -> bool:
        parent, field = self.parents[node]
        if self.in_test(node) or isinstance(parent, ast.Expr):
            return False
        return not any((type(ancestor), name) in _BINDING_VALUES
                       for ancestor, name in self.ancestors(node, within_statement=True))

    def processed(self, node: ast.AST) -> bool:
        """aux's result ``node`` is part of a larger expression (outside tests)."""
        parent, field = self.parents[node]
        whole = field == "value" and isinstance(parent, (ast.Return, ast.Expr, ast.Assign, ast.AnnAssign,
                                                         ast.NamedExpr))
        return not whole and not self.in_test(node)

    def repeated(self, node: ast.AST) -> bool:
        """``node`` runs once per item: in a loop body, a comprehension (not its first iterable), a lambda."""
        for parent, field in self.ancestors(node):
            if (type(parent), field) in _REPEATED:
                return True
            if isinstance(parent, ast.comprehension) and field == "iter":
                outer = self.parents[parent][0]
                if parent is not outer.generators[0]:
                    return True
        return False

    def recomputes(self, nodes: Sequence[ast.AST]) -> bool:
        if not nodes or self.depends(*nodes):
            return False
        seen, stack = [], list(nodes)
        while stack:  # ``raise`` is no fallback answer: skip what is raised
            node = stack.pop()
            if not isinstance(node, ast.Raise):
                seen.append(node)
                stack.extend(ast.iter_child_nodes(node))
        reads_input = any(isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.parameters
                          for node in seen)
        return reads_input and any(isinstance(node, _COMPUTATION) for node in seen)

    def statements_after(self, statement: ast.stmt) -> list[ast.stmt]:
        parent, field = self.parents[statement]
        block = getattr(parent, field)
        return block[block.index(statement) + 1:]


def _line(node: ast.AST) -> str:
    return f"main line {node.lineno}"


def _trivial_reasons(aux: Definition | None, main: Definition | None, aux_name: str,
                     entry_point: str) -> list[str]:
    reasons = []
    main_node = main.node() if main is not None and main.kind == "function" else None
    if main is None or main.kind != "function":
        reasons.append(f"main's code defines no function {entry_point}")
    elif main_node is None:
        reasons.append(f"main's {entry_point} does not parse")
    aux_node = aux.node() if aux is not None and aux.kind == "function" else None
    if aux is None or aux.kind != "function":
        reasons.append(f"the helper's code defines no function {aux_name}")
    elif aux_node is None:
        reasons.append(f"{aux_name} does not parse")
    elif _is_empty(aux_node):
        reasons.append(f"{aux_name} is empty (only pass, ..., return None or raise NotImplementedError)")
    if main_node is not None and not calls_function(main_node, aux_name):
        reasons.append(f"main never calls {aux_name}")
    elif main_node is not None and is_thin_wrapper(main_node, aux_name):
        reasons.append(f"main is a thin wrapper: it forwards its parameters to {aux_name} and returns the result")
    return reasons


def _returns_answer(main: _Main) -> bool:
    """Whether a ``return`` gives aux's result (directly, or as a ternary branch or and/or operand)."""
    def options(value: ast.AST) -> Iterator[ast.AST]:
        if isinstance(value, ast.IfExp):
            yield from options(value.body)
            yield from options(value.orelse)
        elif isinstance(value, ast.BoolOp):
            for operand in value.values:
                yield from options(operand)
        else:
            yield value
    return any(isinstance(node, ast.Return) and node.value is not None
               and any(option in main.calls or main.is_result_load(option) for option in options(node.value))
               for node in ast.walk(main.function))


def _branches(main: _Main, node: ast.AST) -> list[list[ast.AST]]:
    """The alternatives of a conditional on aux's result (see the module docstring), else []."""
    if isinstance(node, ast.If) and main.depends(node.test):
        branches = [node.body, node.orelse]
        if not node.orelse and isinstance(node.body[-1], (ast.Return, ast.Raise)):
            branches.append(main.statements_after(node))
        return branches
    if isinstance(node, ast.IfExp) and main.depends(node.test):
        return [[node.body], [node.orelse]]
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and main.depends(*node.values[:-1]):
        return [[node.values[-1]]]
    return []


def _fallback_reasons(main: _Main) -> list[str]:
    reasons = []
    for node in ast.walk(main.function):
        if isinstance(node, _TRY) and any(main.mentions_aux(statement) for statement in node.body):
            reasons += [f"try/except around {main.aux_name} ({_line(node)}) with a handler that computes "
                        f"its own result ({_line(handler)})" for handler in node.handlers
                        if not all(isinstance(item, _SKIPS) or _does_nothing(item) for item in handler.body)]
    if _returns_answer(main):
        for node in ast.walk(main.function):
            for branch in _branches(main, node):
                if main.recomputes(branch):
                    reasons.append(f"a check on {main.aux_name}'s result ({_line(node)}) leads to main's own "
                                   f"computation from its inputs ({_line(branch[0])})")
    return reasons


def _coordinator_reasons(main: _Main) -> list[str]:
    reasons = [f"{main.aux_name} is called once per item ({_line(call)})" for call in main.calls
               if main.repeated(call)]
    reasons += [f"{main.aux_name} is handed to {ast.unparse(main.receiving_call(node).func)}(...) ({_line(node)}), "
                f"which applies it to many items" for node in main.handed]
    # ast.dump leaves positions out: calls on the same argument text compare equal
    arguments = {(tuple(map(ast.dump, call.args)), tuple(map(ast.dump, call.keywords))) for call in main.calls}
    if len(arguments) > 1:
        reasons.append(f"{main.aux_name} is called on {len(arguments)} different arguments")
    return reasons


def _value_uses(main: _Main) -> list[ast.AST]:
    return [node for node in main.calls + main.handed + main.loads if main.used_as_value(node)]


def _tested(main: _Main) -> list[ast.AST]:
    """The if/while/ternary nodes whose test depends on aux."""
    return [node for node in ast.walk(main.function) if isinstance(node, _CONDITIONALS) and main.depends(node.test)]


def _strategy_reasons(main: _Main) -> list[str]:
    if _value_uses(main):
        return []
    return [f"{main.aux_name}'s result decides the branch of the {type(node).__name__.lower()} at {_line(node)} "
            f"and is used as a value nowhere" for node in _tested(main)]


def _decorator_reasons(main: _Main) -> list[str]:
    reasons = []
    for statement in _without_docstring(main.function.body):
        branch = statement
        while isinstance(branch, ast.If) and not main.mentions_aux(branch.test):  # an if/elif chain
            if isinstance(branch.body[-1], (ast.Return, ast.Raise)) and not any(map(main.mentions_aux, branch.body)):
                reasons.append(f"a guard clause handles an edge case without {main.aux_name} ({_line(branch)})")
            branch = branch.orelse[0] if len(branch.orelse) == 1 else None
        if main.mentions_aux(statement):
            break
    reasons += [f"{main.aux_name}'s result is post-processed ({_line(node)}, {type(main.parents[node][0]).__name__} "
                f"node)" for node in main.calls + main.loads if main.processed(node)]
    if _value_uses(main):
        reasons += [f"an edge case of {main.aux_name}'s result is checked ({_line(node)})" for node in _tested(main)]
    return reasons


_RULES = {"fallback": _fallback_reasons, "coordinator": _coordinator_reasons,
          "strategy_filter": _strategy_reasons, "decorator": _decorator_reasons}


def classify_scheme(aux_completion: str, main_completion: str, entry_point: str,
                    aux_name: str = "aux") -> SchemeResult:
    """The cooperation scheme of one joint action of the coding task (rules in the module docstring).

    ``aux_completion`` is the helper's completion (it should define ``aux_name``), ``main_completion``
    the main agent's (it should define ``entry_point``); both may be markdown with fenced code.

    Raises:
        ValueError: ``entry_point`` or ``aux_name`` is not an identifier, or they are equal.
    """
    for label, value in (("entry_point", entry_point), ("aux_name", aux_name)):
        if not isinstance(value, str) or not value.isidentifier():
            raise ValueError(f"{label} must be a Python identifier, got {value!r}")
    if entry_point == aux_name:
        raise ValueError(f"entry_point and aux_name must differ, both are {entry_point!r}")
    aux, main = extract_code(aux_completion).definition(aux_name), extract_code(main_completion).definition(entry_point)
    trivial = _trivial_reasons(aux, main, aux_name, entry_point)
    if trivial:
        return SchemeResult("trivial", tuple(f"trivial: {reason}" for reason in trivial), ("trivial",))
    facts = _Main(main.node(), aux_name)
    found = {scheme: rule(facts) for scheme, rule in _RULES.items()}
    matched = tuple(scheme for scheme in SCHEMES if found.get(scheme))
    if not matched:
        return SchemeResult("other", (f"other: main calls {aux_name} but matches no scheme's rules",), ("other",))
    reasons = dict.fromkeys(f"{scheme}: {reason}" for scheme in matched for reason in found[scheme])  # dedupe
    return SchemeResult(matched[0], tuple(reasons), matched)


def scheme_distribution(pairs: Iterable[tuple[str, str]], entry_points: str | Sequence[str],
                        aux_name: str = "aux") -> dict[str, float]:
    """The fraction of joint actions in each scheme: every scheme of ``SCHEMES`` is a key, in order.

    ``pairs`` holds ``(aux_completion, main_completion)`` joint actions; ``entry_points`` is the
    entry point of every pair or a sequence with one per pair. Fractions sum to 1.

    Raises:
        ValueError: ``pairs`` is empty, or ``entry_points`` is a sequence of another length.
    """
    pairs = list(pairs)
    if not pairs:
        raise ValueError("pairs must hold at least one (aux_completion, main_completion) pair, got none")
    names = [entry_points] * len(pairs) if isinstance(entry_points, str) else list(entry_points)
    if len(names) != len(pairs):
        raise ValueError(f"entry_points must be one name or one per pair, got {len(names)} for {len(pairs)} pairs")
    counts = dict.fromkeys(SCHEMES, 0)
    for (aux_completion, main_completion), entry_point in zip(pairs, names):
        counts[classify_scheme(aux_completion, main_completion, entry_point, aux_name).scheme] += 1
    return {scheme: count / len(pairs) for scheme, count in counts.items()}
