"""The joint reward of the coding task (helper writes ``aux``, main writes the entry point), max 4.0.

Gated levels, in order (a failed gate stops scoring; parts never reached are absent). N is the number
of the problem's *held* tests (the ones no feedback shows, see ``teamrl.envs.coding``), C the number
of held tests that pass *because of aux* (measured, below):

======================  ===========  ========================================================
part                    value        when
======================  ===========  ========================================================
``aux_structure``       0.4          the helper defined ``aux`` and it returns something
``main_structure``      0.6          the main agent defined the entry point. **Gate**: else stop.
``syntax``              0.5          the joined program parses. **Gate**: else stop.
``tests``               0..1         passed / N held tests (run in the sandbox)
``cooperation``         0.5 x C/N    ``aux_structure`` earned, main calls aux, C > 0. **Gate**
                                     for the two parts below.
``non_wrapper``         1.0 x C/N    main is not a thin wrapper of aux (syntax or behaviour)
``ignored_aux_result``  -0.5 x C/N   main calls aux as a bare expression statement
======================  ===========  ========================================================

Definitions on the AST of the agents' own code (``teamrl.rewards.code_extract``):

- *aux returns something*: aux's own body (not nested functions, lambdas or classes) has a
  ``return <value>`` whose value is not the constant ``None``. A definition that does not parse is
  judged by its lines instead: an indented ``return`` followed by something other than ``None``.
- *main calls aux*: main's body, nested scopes included, calls ``aux(...)`` or passes ``aux`` as an
  argument of a call (``map(aux, xs)``, ``sorted(xs, key=aux)``). Only the gate that decides whether
  cooperation is worth measuring: what pays is measured.
- *thin wrapper by syntax* (the paper's): main's body, after a leading docstring, is exactly ``return
  aux(ARGS)``, or ``v = aux(ARGS)`` followed by ``return v``, where every argument in ARGS is one of
  main's parameters or a literal constant.
- *aux result ignored*: somewhere in main there is an expression statement that is a bare call
  ``aux(...)``, whose value is thrown away.

**Cooperation, measured** (``measure_cooperation``). The paper pays +0.5 when main's code calls aux
and a test passes, and +1.0 more when main is not a thin wrapper, both read off the syntax: a call
under ``if False:``, a decorator that swaps the function the analysis saw, or ``r = aux(x); return r
if True else None`` collect the 1.5 (more than the whole tests part) without aux doing anything for a
passing test. Here the held tests the program passed run again, each run in a fresh sandbox, with aux
replaced (:class:`ProbePrograms`):

1. *stubbed*: aux, with its own name and parameters, returns a bare ``object()`` and computes nothing;
2. *perturbed*: aux runs, and its result becomes another value of the same type (every number in it
   x -> 3x + 1, a container's first item dropped, a string shifted, a bool flipped);
3. *alone* (where aux contributed, main did not just forward it, and aux takes the entry point's
   parameters): the entry point is aux.

A passing test *depends on aux* when it fails, to the end (not cut off by a time limit), stubbed or
perturbed: main's answer needs what aux computes, or moves with it. Both, because one replacement
value cannot break every honest use: a truthy stub leaves ``sum(1 for x in xs if aux(x))`` right for
``[97]``, and a perturbed list leaves an ``any(...)`` over it True on many inputs. But when no test
fails perturbed, main's answers never moved with aux's value: it only looked at the result (``assert
isinstance(aux(x), list)``, ``len(aux(x))``) and computed them itself, and then nothing counts. Main
is *thin by behaviour* when, stubbed, it handed the stub's object back on every passing test
(``return r if True else None`` does, through any control flow), or when aux alone passes every test
main passes (``return list(aux(x))``; a main that validates aux's result and returns it). The parts
scale with C/N, so a cooperating program that passes one test of ten earns a tenth of the bonus, not
all of it, and a correct solution whose every held test depends on aux still earns the paper's full
1.5. Out of reach, documented rather than claimed: a main whose answers depend on aux's value on one
test and only on its type on the others; a main that depends on aux's value only through a check of
its exact value (``assert aux(x) == x``); a program that inspects its own code to tell the probes
apart (code written against this grader, which no observation shows).

**Individual rewards** (``individual_code_rewards``; the independent-learner baseline,
``algorithm.learners=individual``): each agent's own parts of the joint reward, same values, gated
the same way:

=======  ==================  =====  ==========================================================
agent    part                value  when
=======  ==================  =====  ==========================================================
helper   ``aux_structure``   0.4    it defined ``aux`` and aux returns something. **Gate**: aux
                                    defined, else stop.
helper   ``syntax``          0.5    its own code (what it adds to the joined program) parses
main     ``main_structure``  0.6    it defined the entry point. **Gate**: else stop.
main     ``syntax``          0.5    its own code (without any ``aux`` it wrote, which the joined
                                    program drops) parses. **Gate**: else stop.
main     ``tests``           0..1   passed / N held tests of the joined program (0 when it
                                    did not run: the helper's code broke the joined program)
=======  ==================  =====  ==========================================================

Maxima: helper 0.9, main 2.1. The joined program parses exactly when both agents' own code does, so
the joint ``syntax`` part splits between them. The tests run what the problem asks for, the main
agent's function, so they are the main agent's part; they are the one part that still depends on the
partner: the tests run the joined program, and when main calls ``aux`` its result is the helper's
work (running main without ``aux`` instead would punish exactly the calls the task asks for, and
running the programs twice is what the shared grade avoids). The cooperation parts depend on both
agents by definition and have no individual counterpart.

The pure part (``analyse_team_code``) needs no execution; ``code_reward`` combines it with the
sandbox record of the joined program's held tests and the cooperation probe; ``grade_team_code`` does
all of it for a batch through a pool; ``individual_code_rewards`` reads each agent's own reward off a
grade, running nothing.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from teamrl.feedback.static import UnanalysableCode, parse_code
from teamrl.rewards.base import RewardResult
from teamrl.rewards.code_extract import Definition, ExtractedCode, extract_code, join_team_program
from teamrl.sandbox import ExecutionRecord, Program, SandboxPool, TestOutcome

AUX_STRUCTURE = 0.4
MAIN_STRUCTURE = 0.6
SYNTAX = 0.5
TESTS = 1.0
COOPERATION = 0.5
NON_WRAPPER = 1.0
IGNORED_AUX_RESULT = -0.5
MAX_REWARD = AUX_STRUCTURE + MAIN_STRUCTURE + SYNTAX + TESTS + COOPERATION + NON_WRAPPER

#: A completion without code: joined with one agent's code, it gives the part that agent adds to the program.
_NO_CODE = ExtractedCode(imports=(), definitions=())
_RETURNS_LINE = re.compile(r"^[ \t]+return[ \t]+(?!None[ \t]*(?:#.*)?$)\S", re.MULTILINE)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class CodeAnalysis:
    """What the code reward needs to know about a joint action before (and besides) running it.

    Attributes:
        aux_defined: the helper's code defines ``aux``.
        aux_returns: that ``aux`` returns something (see the module docstring).
        main_defined: the main agent's code defines the entry point.
        program: the joined program (helper's code, then main's) that the tests run against.
        syntax_error: why ``program`` does not parse (``line L, column C: message``), or None.
        helper_syntax_error, main_syntax_error: the same for each agent's own part of ``program``
            (the main agent's without any ``aux`` it wrote); ``program`` parses exactly when both do.
        main_calls_aux, main_is_thin_wrapper, aux_result_ignored: the syntactic cooperation facts
            (the paper's); False when main is missing or does not parse.
        probes: the programs that measure what aux contributes (:class:`ProbePrograms`), when
            cooperation can pay at all (aux defined and returning, main calling it, both parsing).
    """

    aux_defined: bool
    aux_returns: bool
    main_defined: bool
    program: str
    syntax_error: str | None
    helper_syntax_error: str | None
    main_syntax_error: str | None
    main_calls_aux: bool
    main_is_thin_wrapper: bool
    aux_result_ignored: bool
    probes: ProbePrograms | None = None

    @property
    def syntax_ok(self) -> bool:
        """The joined program parses."""
        return self.syntax_error is None

    @property
    def needs_tests(self) -> bool:
        """The reward depends on running the tests (main is defined and the program parses)."""
        return self.main_defined and self.syntax_ok


@dataclass(frozen=True)
class ProbePrograms:
    """The joined program with aux replaced, three ways.

    Attributes:
        stub: aux (same name and parameters) returns a bare ``object()`` and does nothing else; the
            helper's other definitions are left out.
        perturbed: aux runs as written, and its result becomes another value of the same type (every
            number in it x -> 3x + 1, a container's first item dropped, a string's first character
            replaced by a ``#`` at its end, a bool flipped).
        aux_alone: the entry point is aux itself (main's definition left out); None when aux's
            parameters are not the entry point's, so it cannot stand in for it.
    """

    stub: str
    perturbed: str
    aux_alone: str | None


@dataclass(frozen=True)
class CooperationProbe:
    """What aux contributes to the held tests the program passed (module docstring, "Cooperation").

    Attributes:
        passed: the held tests the program passed (indices into the held tests).
        contributed: those that fail, to the end (not cut off by a time limit), with aux stubbed or
            with aux's results perturbed; none when no test fails perturbed.
        forwarded: on every test of ``passed``, main handed the stub's result back unchanged.
        aux_alone: aux, called as the entry point, passes every test of ``passed``; None: not run (no
            contribution, main forwarding, or aux's parameters differ from the entry point's).
        stub_record, perturbed_record: the stubbed and the perturbed runs over ``passed``.
        aux_alone_record: the aux-alone run over ``passed`` (None: not run).
    """

    passed: tuple[int, ...]
    contributed: tuple[int, ...]
    forwarded: bool
    aux_alone: bool | None
    stub_record: ExecutionRecord
    perturbed_record: ExecutionRecord | None = None
    aux_alone_record: ExecutionRecord | None = None

    @property
    def thin(self) -> bool:
        """Main added nothing of its own by behaviour: it forwarded aux's result on every passed test,
        or aux alone passes them all."""
        return self.forwarded or bool(self.aux_alone)


@dataclass(frozen=True)
class CodeGrade:
    """One joint action's analysis, sandbox records (None when tests were not needed) and reward.

    Attributes:
        analysis: the static analysis.
        record: the run of the held tests, which the reward and pass@k count.
        reward: the joint reward.
        shown_record: the run of the shown tests, which feedback may reveal (None: none given or not run).
        probe: the cooperation measurement (None where cooperation could not pay).
    """

    analysis: CodeAnalysis
    record: ExecutionRecord | None
    reward: RewardResult
    shown_record: ExecutionRecord | None = None
    probe: CooperationProbe | None = None


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """Nodes of a function's body, not descending into nested functions, lambdas or classes."""
    nodes, stack = [], list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        nodes.append(node)
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))
    return nodes


def returns_value(definition: Definition) -> bool:
    """Whether a function returns something other than ``None`` (see the module docstring)."""
    node = definition.node()
    if node is None:
        return _RETURNS_LINE.search(definition.source) is not None
    return any(isinstance(item, ast.Return) and item.value is not None
               and not (isinstance(item.value, ast.Constant) and item.value.value is None)
               for item in _own_nodes(node))


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def calls_function(function: ast.AST, name: str) -> bool:
    """Whether ``function`` calls ``name`` or hands it to a call as an argument."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            arguments = [arg.value if isinstance(arg, ast.Starred) else arg for arg in node.args]
            arguments += [keyword.value for keyword in node.keywords]
            if _is_name(node.func, name) or any(_is_name(arg, name) for arg in arguments):
                return True
    return False


def ignores_result(function: ast.AST, name: str) -> bool:
    """Whether ``function`` has a bare ``name(...)`` expression statement."""
    return any(isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _is_name(node.value.func, name)
               for node in ast.walk(function))


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    named = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return {arg.arg for arg in named}


def _is_passthrough_call(node: ast.AST | None, name: str, parameters: set[str]) -> bool:
    if not (isinstance(node, ast.Call) and _is_name(node.func, name)):
        return False
    values = [arg.value if isinstance(arg, ast.Starred) else arg for arg in node.args]
    values += [keyword.value for keyword in node.keywords]
    return all(isinstance(value, ast.Constant) or (isinstance(value, ast.Name) and value.id in parameters)
               for value in values)


def is_thin_wrapper(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> bool:
    """Whether ``function`` only forwards its parameters to ``name`` and returns the result as is."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    parameters = _parameters(function)
    if len(body) == 1 and isinstance(body[0], ast.Return):
        return _is_passthrough_call(body[0].value, name, parameters)
    if len(body) == 2 and isinstance(body[1], ast.Return) and isinstance(body[1].value, ast.Name):
        first, returned = body[0], body[1].value.id
        if isinstance(first, ast.Assign) and len(first.targets) == 1:
            target, value = first.targets[0], first.value
        elif isinstance(first, ast.AnnAssign):
            target, value = first.target, first.value
        else:
            return False
        return _is_name(target, returned) and _is_passthrough_call(value, name, parameters)
    return False


# ------------------------------------------------------------------------------------------------
# Measuring cooperation: the joined program with aux replaced


#: The type name the judge reports for what the stubbed aux returns (a bare ``object()``).
STUB_RESULT_TYPE = "object"
_PERTURBED = "_teamrl_perturbed"
_REAL_AUX = "_teamrl_real_aux"
# Another value of the same type (a check of its type passes), every number in it moved and scaled
# and a container one item shorter, so that an answer built on it changes.
_PERTURBED_SOURCE = f'''def {_PERTURBED}(value, depth=0):
    kind = type(value)
    if depth > 20:
        return value
    if kind is bool:
        return not value
    if kind in (int, complex):
        return 3 * value + 1
    if kind is float:
        moved = 3 * value + 1
        return moved if value - value == 0 and moved != value else 0.0 if value != 0.0 else 1.0
    if kind is str:
        return value[1:] + "#"
    if kind is bytes:
        return value[1:] + b"#"
    if kind in (list, tuple, set, frozenset):
        items = [{_PERTURBED}(item, depth + 1) for item in list(value)[1:]]
        return kind(items) if value else kind([0])
    if kind is dict:
        pairs = [(key, {_PERTURBED}(item, depth + 1)) for key, item in list(value.items())[1:]]
        return dict(pairs) if value else {{0: 0}}
    return object()
'''


def _parameter_kinds(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, str]]:
    """A function's parameters as (kind, name), in order: what a caller can pass it."""
    args = function.args
    return ([("positional-only", arg.arg) for arg in args.posonlyargs] + [("positional", arg.arg) for arg in args.args]
            + ([("*", args.vararg.arg)] if args.vararg else []) + [("keyword-only", arg.arg) for arg in args.kwonlyargs]
            + ([("**", args.kwarg.arg)] if args.kwarg else []))


def _with_body(function: ast.FunctionDef | ast.AsyncFunctionDef, body: list[ast.stmt]) -> str:
    """``function``'s header (name, parameters and defaults; no decorators or annotations) over ``body``."""
    header = copy.deepcopy(function)
    header.decorator_list, header.returns, header.body = [], None, body
    args = header.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    return ast.unparse(ast.fix_missing_locations(header))


def _forwarding_call(function: ast.FunctionDef | ast.AsyncFunctionDef, callee: str) -> ast.Call:
    """``callee(...)`` passing on every parameter of ``function`` as it was received."""
    args = function.args
    positional: list[ast.expr] = [ast.Name(arg.arg, ast.Load()) for arg in [*args.posonlyargs, *args.args]]
    if args.vararg:
        positional.append(ast.Starred(ast.Name(args.vararg.arg, ast.Load()), ast.Load()))
    keywords = [ast.keyword(arg.arg, ast.Name(arg.arg, ast.Load())) for arg in args.kwonlyargs]
    if args.kwarg:
        keywords.append(ast.keyword(None, ast.Name(args.kwarg.arg, ast.Load())))
    return ast.Call(ast.Name(callee, ast.Load()), positional, keywords)


def probe_programs(aux_code: ExtractedCode, main_code: ExtractedCode, entry_point: str,
                   aux_name: str = "aux") -> ProbePrograms:
    """The programs of :class:`ProbePrograms` for a helper's and a main agent's code.

    Raises:
        ValueError: either code lacks a parsable function of its name.
    """
    aux, main = aux_code.definition(aux_name), main_code.definition(entry_point)
    aux_node, main_node = (aux.node() if aux else None), (main.node() if main else None)
    if not isinstance(aux_node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            or not isinstance(main_node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError(f"probe_programs: needs parsable functions {aux_name!r} and {entry_point!r}")
    stub = Definition(aux_name, "function", _with_body(aux_node, [ast.Return(ast.Call(
        ast.Name("object", ast.Load()), [], []))]), True)
    wrapper = "\n\n\n".join([f"{_REAL_AUX} = {aux_name}", _with_body(aux_node, [ast.Return(ast.Call(
        ast.Name(_PERTURBED, ast.Load()), [_forwarding_call(aux_node, _REAL_AUX)], []))]), _PERTURBED_SOURCE.rstrip()])
    perturbed = ExtractedCode(aux_code.imports,
                              (*aux_code.definitions, Definition(aux_name, "function", wrapper, True)))
    aux_alone = None
    if _parameter_kinds(aux_node) == _parameter_kinds(main_node):
        main_rest = ExtractedCode(main_code.imports, tuple(d for d in main_code.definitions if d.name != entry_point))
        aux_alone = join_team_program(aux_code, main_rest, aux_name) + f"\n\n{entry_point} = {aux_name}\n"
    return ProbePrograms(stub=join_team_program(ExtractedCode(aux_code.imports, (stub,)), main_code, aux_name),
                         perturbed=join_team_program(perturbed, main_code, aux_name), aux_alone=aux_alone)


def _syntax_error(program: str) -> str | None:
    """Why ``program`` does not parse, or None; code too long or too deeply nested to analyse
    (:func:`teamrl.feedback.static.parse_code`) does not parse either."""
    try:
        parse_code(program)
    except SyntaxError as error:
        where = f"line {error.lineno}, column {error.offset}: " if error.lineno is not None else ""
        return where + error.msg
    except UnanalysableCode as error:
        return error.failure.to_text()
    return None


def analyse_team_code(aux_completion: str, main_completion: str, entry_point: str,
                      aux_name: str = "aux") -> CodeAnalysis:
    """Extract, join and statically analyse one joint action of the coding task (no execution)."""
    for label, value in (("entry_point", entry_point), ("aux_name", aux_name)):
        if not isinstance(value, str) or not value.isidentifier():
            raise ValueError(f"{label} must be a Python identifier, got {value!r}")
    if entry_point == aux_name:
        raise ValueError(f"entry_point and aux_name must differ, both are {entry_point!r}")
    aux_code, main_code = extract_code(aux_completion), extract_code(main_completion)
    aux = aux_code.definition(aux_name)
    main = main_code.definition(entry_point)
    aux_defined = aux is not None and aux.kind == "function"
    main_defined = main is not None and main.kind == "function"
    main_node = main.node() if main_defined else None
    program = join_team_program(aux_code, main_code, aux_name)
    syntax_error = _syntax_error(program)
    main_calls_aux = main_node is not None and calls_function(main_node, aux_name)
    cooperation_possible = aux_defined and returns_value(aux) and syntax_error is None and main_calls_aux
    return CodeAnalysis(
        aux_defined=aux_defined,
        aux_returns=aux_defined and returns_value(aux),
        main_defined=main_defined,
        program=program,
        syntax_error=syntax_error,
        helper_syntax_error=_syntax_error(join_team_program(aux_code, _NO_CODE, aux_name)),
        main_syntax_error=_syntax_error(join_team_program(_NO_CODE, main_code, aux_name)),
        main_calls_aux=main_calls_aux,
        main_is_thin_wrapper=main_node is not None and is_thin_wrapper(main_node, aux_name),
        aux_result_ignored=main_node is not None and ignores_result(main_node, aux_name),
        probes=probe_programs(aux_code, main_code, entry_point, aux_name) if cooperation_possible else None,
    )


def cooperation_can_pay(analysis: CodeAnalysis, record: ExecutionRecord | None) -> bool:
    """The cooperation parts' gate: aux defined and returning, main calling it, a held test passed."""
    return analysis.probes is not None and record is not None and record.passed > 0


def code_reward(analysis: CodeAnalysis, record: ExecutionRecord | None,
                probe: CooperationProbe | None = None) -> RewardResult:
    """The gated coding reward from the static analysis, the sandbox record of its program's held tests
    and, where cooperation can pay (:func:`cooperation_can_pay`), the cooperation probe.

    Raises:
        ValueError: ``record`` is None although the program needs testing, or it holds no tests; or
            ``probe`` is None where cooperation can pay (:func:`measure_cooperation` makes it).
    """
    parts = {"aux_structure": AUX_STRUCTURE if analysis.aux_defined and analysis.aux_returns else 0.0,
             "main_structure": MAIN_STRUCTURE if analysis.main_defined else 0.0}
    if analysis.main_defined:
        parts["syntax"] = SYNTAX if analysis.syntax_ok else 0.0
    if analysis.needs_tests:
        if record is None:
            raise ValueError("code_reward: the program parses, so its sandbox record is required, got None")
        parts["tests"] = _tests_part(record, "code_reward")
        share = 0.0
        if cooperation_can_pay(analysis, record):
            if probe is None:
                raise ValueError("code_reward: cooperation can pay here, so its probe is required "
                                 "(teamrl.rewards.code.measure_cooperation), got None")
            share = len(probe.contributed) / record.total
        parts["cooperation"] = COOPERATION * share
        if share > 0:
            thin = analysis.main_is_thin_wrapper or probe.thin
            parts["non_wrapper"] = 0.0 if thin else NON_WRAPPER * share
            parts["ignored_aux_result"] = IGNORED_AUX_RESULT * share if analysis.aux_result_ignored else 0.0
    return RewardResult(total=sum(parts.values()), parts=parts)


def _tests_part(record: ExecutionRecord, caller: str) -> float:
    if record.total == 0:
        raise ValueError(f"{caller}: the sandbox record has no tests; the tests part is undefined")
    return TESTS * record.passed / record.total


def helper_reward(analysis: CodeAnalysis) -> RewardResult:
    """The helper's own reward (max 0.9; module docstring): ``aux_structure``, then, when it defined
    ``aux``, ``syntax`` of its own code."""
    parts = {"aux_structure": AUX_STRUCTURE if analysis.aux_defined and analysis.aux_returns else 0.0}
    if analysis.aux_defined:
        parts["syntax"] = SYNTAX if analysis.helper_syntax_error is None else 0.0
    return RewardResult(total=sum(parts.values()), parts=parts)


def main_reward(analysis: CodeAnalysis, record: ExecutionRecord | None) -> RewardResult:
    """The main agent's own reward (max 2.1; module docstring): ``main_structure``, then ``syntax`` of its
    own code, then ``tests`` from ``record``, the sandbox run of the joined program (None: not run).

    Raises:
        ValueError: ``record`` holds no tests.
    """
    parts = {"main_structure": MAIN_STRUCTURE if analysis.main_defined else 0.0}
    if analysis.main_defined:
        parts["syntax"] = SYNTAX if analysis.main_syntax_error is None else 0.0
        if analysis.main_syntax_error is None:
            parts["tests"] = _tests_part(record, "main_reward") if record is not None else 0.0
    return RewardResult(total=sum(parts.values()), parts=parts)


def individual_code_rewards(grade: CodeGrade) -> list[RewardResult]:
    """[helper's own reward, main agent's own reward] of a graded joint action, running nothing."""
    return [helper_reward(grade.analysis), main_reward(grade.analysis, grade.record)]


def _failed_with_verdict(outcome: TestOutcome) -> bool:
    """The test failed and that says something about the program: it was run to the end (not cut off
    by a time limit, nor left unrun)."""
    return not outcome.passed and not outcome.timed_out and outcome.error_type != "NotRun"


def measure_cooperation(programs: Sequence[tuple[ProbePrograms, ExecutionRecord, Program]],
                        pool: SandboxPool) -> list[CooperationProbe]:
    """Run each program's held tests that passed again with aux replaced (:class:`ProbePrograms`), in
    fresh sandboxes: stubbed and perturbed; then, where aux contributed and main did not just forward
    its result, aux alone.

    ``programs[i]`` is (the probe programs, the record of the held tests, the Program that made it: its
    held tests first, in the record's order, and its setup). Each run gets its own sandbox, so nothing
    a run leaves behind (scratch files, IPC objects) can tell a program it is being probed.
    """
    def rerun(code: str, program: Program, indices: Sequence[int]) -> Future[ExecutionRecord]:
        return pool.submit(Program(_with_preamble(program.setup, code), tuple(program.tests[i] for i in indices),
                                   program.setup))

    def failed(indices: Sequence[int], record: ExecutionRecord) -> set[int]:
        return {index for index, outcome in zip(indices, record.tests) if _failed_with_verdict(outcome)}

    passed = [tuple(o.index for o in record.tests if o.passed) for _, record, _ in programs]
    runs = [(rerun(probes.stub, program, indices), rerun(probes.perturbed, program, indices))
            for (probes, _, program), indices in zip(programs, passed)]
    measured = []
    for (probes, _, program), indices, (stub_run, perturbed_run) in zip(programs, passed, runs):
        stub, perturbed = stub_run.result(), perturbed_run.result()
        # A main whose answers never move with aux's value only looked at the result (its type, its
        # length): then what the stub broke says nothing either.
        moved = failed(indices, perturbed)
        contributed = tuple(sorted(failed(indices, stub) | moved)) if moved else ()
        forwarded = all(STUB_RESULT_TYPE in outcome.opaque_results for outcome in stub.tests)
        alone = rerun(probes.aux_alone, program, indices) \
            if contributed and not forwarded and probes.aux_alone is not None else None
        measured.append((indices, contributed, forwarded, stub, perturbed, alone))
    return [CooperationProbe(passed=indices, contributed=contributed, forwarded=forwarded,
                             aux_alone=alone.result().all_passed if alone is not None else None, stub_record=stub,
                             perturbed_record=perturbed, aux_alone_record=alone.result() if alone is not None else None)
            for indices, contributed, forwarded, stub, perturbed, alone in measured]


def _split_record(record: ExecutionRecord, held: int) -> tuple[ExecutionRecord, ExecutionRecord]:
    """The records of a run's first ``held`` tests and of the rest (re-indexed from 0)."""
    rest = tuple(dataclasses.replace(outcome, index=outcome.index - held) for outcome in record.tests[held:])
    return dataclasses.replace(record, tests=record.tests[:held]), dataclasses.replace(record, tests=rest)


def grade_team_code(aux_completions: Sequence[str], main_completions: Sequence[str],
                    entry_points: Sequence[str], tests: Sequence[Sequence[str]], pool: SandboxPool,
                    aux_name: str = "aux", preambles: Sequence[str] | None = None,
                    shown_tests: Sequence[Sequence[str]] | None = None) -> list[CodeGrade]:
    """Analyse, run (concurrently, only where needed) and score a batch of joint actions.

    Item ``i`` is the helper's ``aux_completions[i]`` with the main agent's ``main_completions[i]``
    for the problem with ``entry_points[i]``, graded on the held test snippets ``tests[i]`` (see
    ``teamrl.sandbox.Program``; ``teamrl.sandbox.humaneval_tests`` makes them from HumanEval).
    ``shown_tests[i]`` run in the same sandbox after them, for feedback only (``CodeGrade.shown_record``);
    they earn nothing. ``preambles[i]`` (the problem's own imports and helpers, e.g. HumanEval prompts'
    ``poly``) is placed before the agents' code in the program the tests run; it earns no reward.
    Where cooperation can pay, it is measured (:func:`measure_cooperation`).
    """
    count = len(aux_completions)
    preambles = preambles if preambles is not None else [""] * count
    shown_tests = shown_tests if shown_tests is not None else [()] * count
    sizes = {"aux_completions": count, "main_completions": len(main_completions), "entry_points": len(entry_points),
             "tests": len(tests), "preambles": len(preambles), "shown_tests": len(shown_tests)}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"grade_team_code: inputs must have the same length, got {sizes}")
    analyses = [analyse_team_code(aux, main, entry, aux_name)
                for aux, main, entry in zip(aux_completions, main_completions, entry_points)]
    programs = [Program(_with_preamble(preamble, analysis.program), (*held, *shown), setup=preamble)
                if analysis.needs_tests else None
                for analysis, held, shown, preamble in zip(analyses, tests, shown_tests, preambles)]
    futures = [pool.submit(program) if program is not None else None for program in programs]
    records: list[tuple[ExecutionRecord | None, ExecutionRecord | None]] = []
    for future, held in zip(futures, tests):
        records.append(_split_record(future.result(), len(held)) if future is not None else (None, None))
    to_probe = [index for index, (analysis, (record, _)) in enumerate(zip(analyses, records))
                if cooperation_can_pay(analysis, record)]
    measured = measure_cooperation([(analyses[i].probes, records[i][0], programs[i]) for i in to_probe], pool)
    probes: list[CooperationProbe | None] = [None] * count
    for index, probe in zip(to_probe, measured):
        probes[index] = probe
    return [CodeGrade(analysis=analysis, record=record, reward=code_reward(analysis, record, probe),
                      shown_record=shown if shown is not None and shown.total else None, probe=probe)
            for analysis, (record, shown), probe in zip(analyses, records, probes)]


def _with_preamble(preamble: str, program: str) -> str:
    return f"{preamble}\n\n{program}" if preamble.strip() else program
