"""The joint reward of the coding task (helper writes ``aux``, main writes the entry point), max 4.0.

Gated levels, in order (a failed gate stops scoring; parts never reached are absent):

======================  =====  ==============================================================
part                    value  when
======================  =====  ==============================================================
``aux_structure``       0.4    the helper defined ``aux`` and it returns something
``main_structure``      0.6    the main agent defined the entry point. **Gate**: else stop.
``syntax``              0.5    the joined program parses. **Gate**: else stop.
``tests``               0..1   passed / total tests (run in the sandbox)
``cooperation``         0.5    at least one test passed, ``aux_structure`` was earned and
                               main calls aux. **Gate** for the two parts below.
``non_wrapper``         1.0    main is not a thin wrapper of aux (definition below)
``ignored_aux_result``  -0.5   main calls aux as a bare expression statement
======================  =====  ==============================================================

Definitions, all on the AST of the agents' own code (``teamrl.envs.code_extract``):

- *aux returns something*: aux's own body (not nested functions, lambdas or classes) has a
  ``return <value>`` whose value is not the constant ``None``. A definition that does not parse is
  judged by its lines instead: an indented ``return`` followed by something other than ``None``.
- *main calls aux*: main's body, nested scopes included, calls ``aux(...)`` or passes ``aux`` as an
  argument of a call (``map(aux, xs)``, ``sorted(xs, key=aux)``).
- *thin wrapper*: main's body, after a leading docstring, is exactly ``return aux(ARGS)``, or
  ``v = aux(ARGS)`` followed by ``return v``, where every argument in ARGS (positional, ``*``,
  keyword, ``**``) is one of main's parameters or a literal constant. Main then adds no work of its
  own; any computation on the inputs or the result, any branch, any other statement makes it not
  thin (stricter about what counts as work than the paper's line-based check: ``return
  aux(sorted(xs))`` is *not* thin here).
- *aux result ignored*: somewhere in main there is an expression statement that is a bare call
  ``aux(...)``, whose value is thrown away.

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
main     ``tests``           0..1   passed / total tests of the joined program (0 when it did
                                    not run: the helper's code broke the joined program)
=======  ==================  =====  ==========================================================

Maxima: helper 0.9, main 2.1. The joined program parses exactly when both agents' own code does, so
the joint ``syntax`` part splits between them. The tests run what the problem asks for, the main
agent's function, so they are the main agent's part; they are the one part that still depends on the
partner: the tests run the joined program, and when main calls ``aux`` its result is the helper's
work (running main without ``aux`` instead would punish exactly the calls the task asks for, and
running the programs twice is what the shared grade avoids). The cooperation parts depend on both
agents by definition and have no individual counterpart.

The pure part (``analyse_team_code``) needs no execution; ``code_reward`` combines it with the
sandbox record of the joined program; ``grade_team_code`` does both for a batch through a pool;
``individual_code_rewards`` reads each agent's own reward off a grade, running nothing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass

from teamrl.envs.code_extract import Definition, ExtractedCode, extract_code, join_team_program
from teamrl.rewards.base import RewardResult
from teamrl.sandbox import ExecutionRecord, Program, SandboxPool

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
        main_calls_aux, main_is_thin_wrapper, aux_result_ignored: the cooperation facts; False when
            main is missing or does not parse.
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

    @property
    def syntax_ok(self) -> bool:
        """The joined program parses."""
        return self.syntax_error is None

    @property
    def needs_tests(self) -> bool:
        """The reward depends on running the tests (main is defined and the program parses)."""
        return self.main_defined and self.syntax_ok


@dataclass(frozen=True)
class CodeGrade:
    """One joint action's analysis, sandbox record (None when tests were not needed) and reward."""

    analysis: CodeAnalysis
    record: ExecutionRecord | None
    reward: RewardResult


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


def _syntax_error(program: str) -> str | None:
    try:
        ast.parse(program)
    except SyntaxError as error:
        return f"line {error.lineno}, column {error.offset}: {error.msg}"
    except (ValueError, RecursionError, MemoryError) as error:
        return f"{type(error).__name__}: {error}"
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
    return CodeAnalysis(
        aux_defined=aux_defined,
        aux_returns=aux_defined and returns_value(aux),
        main_defined=main_defined,
        program=program,
        syntax_error=_syntax_error(program),
        helper_syntax_error=_syntax_error(join_team_program(aux_code, _NO_CODE, aux_name)),
        main_syntax_error=_syntax_error(join_team_program(_NO_CODE, main_code, aux_name)),
        main_calls_aux=main_node is not None and calls_function(main_node, aux_name),
        main_is_thin_wrapper=main_node is not None and is_thin_wrapper(main_node, aux_name),
        aux_result_ignored=main_node is not None and ignores_result(main_node, aux_name),
    )


def code_reward(analysis: CodeAnalysis, record: ExecutionRecord | None) -> RewardResult:
    """The gated coding reward from the static analysis and the sandbox record of its program.

    Raises:
        ValueError: ``record`` is None although the program needs testing, or it holds no tests.
    """
    parts = {"aux_structure": AUX_STRUCTURE if analysis.aux_defined and analysis.aux_returns else 0.0,
             "main_structure": MAIN_STRUCTURE if analysis.main_defined else 0.0}
    if analysis.main_defined:
        parts["syntax"] = SYNTAX if analysis.syntax_ok else 0.0
    if analysis.needs_tests:
        if record is None:
            raise ValueError("code_reward: the program parses, so its sandbox record is required, got None")
        parts["tests"] = _tests_part(record, "code_reward")
        cooperating = record.passed > 0 and parts["aux_structure"] > 0 and analysis.main_calls_aux
        parts["cooperation"] = COOPERATION if cooperating else 0.0
        if cooperating:
            parts["non_wrapper"] = 0.0 if analysis.main_is_thin_wrapper else NON_WRAPPER
            parts["ignored_aux_result"] = IGNORED_AUX_RESULT if analysis.aux_result_ignored else 0.0
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


def grade_team_code(aux_completions: Sequence[str], main_completions: Sequence[str],
                    entry_points: Sequence[str], tests: Sequence[Sequence[str]], pool: SandboxPool,
                    aux_name: str = "aux", preambles: Sequence[str] | None = None) -> list[CodeGrade]:
    """Analyse, run (concurrently, only where needed) and score a batch of joint actions.

    Item ``i`` is the helper's ``aux_completions[i]`` with the main agent's ``main_completions[i]``
    for the problem with ``entry_points[i]`` and test snippets ``tests[i]`` (see
    ``teamrl.sandbox.Program``; ``teamrl.sandbox.humaneval_tests`` makes them from HumanEval).
    ``preambles[i]`` (the problem's own imports and helpers, e.g. HumanEval prompts' ``poly``) is
    placed before the agents' code in the program the tests run; it earns no reward.
    """
    preambles = preambles if preambles is not None else [""] * len(aux_completions)
    sizes = {"aux_completions": len(aux_completions), "main_completions": len(main_completions),
             "entry_points": len(entry_points), "tests": len(tests), "preambles": len(preambles)}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"grade_team_code: inputs must have the same length, got {sizes}")
    analyses = [analyse_team_code(aux, main, entry, aux_name)
                for aux, main, entry in zip(aux_completions, main_completions, entry_points)]
    futures = [pool.submit(Program(_with_preamble(preamble, analysis.program), tuple(item_tests), setup=preamble))
               if analysis.needs_tests else None
               for analysis, item_tests, preamble in zip(analyses, tests, preambles)]
    grades = []
    for analysis, future in zip(analyses, futures):
        record = future.result() if future is not None else None
        grades.append(CodeGrade(analysis=analysis, record=record, reward=code_reward(analysis, record)))
    return grades


def _with_preamble(preamble: str, program: str) -> str:
    return f"{preamble}\n\n{program}" if preamble.strip() else program
