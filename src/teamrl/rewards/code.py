"""The joint reward of the coding task (helper writes ``aux``, main writes the entry point), max 4.0.

Gated levels, in order (a failed gate stops scoring; parts never reached are absent). N is the number
of the problem's *held* tests (the ones no feedback shows, see ``teamrl.envs.coding``), C the number
of held tests whose answer main provably built on aux's (measured, below), T those of C where main's
answer is aux's answer or a part of it:

======================  ===============  ====================================================
part                    value            when
======================  ===============  ====================================================
``aux_structure``       0.4              the helper defined ``aux`` and it returns something
``main_structure``      0.6              the main agent defined the entry point. **Gate**: else stop.
``syntax``              0.5              the joined program parses. **Gate**: else stop.
``tests``               0..1             passed / N held tests (run in the sandbox)
``cooperation``         0.5 x C/N        ``aux_structure`` earned, main calls aux, C > 0. **Gate**
                                         for the two parts below.
``non_wrapper``         1.0 x (C-T)/N    main is not a thin wrapper of aux by syntax (else 0)
``ignored_aux_result``  -0.5 x C/N       main calls aux as a bare expression statement
======================  ===============  ====================================================

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
passing test. Measuring it by behaviour is no better where the program can tell a probe from the real
run, or where failing a probe pays: a main that computes its answer itself and checks aux's value
(``if aux(x) != 1: return None``, ``{'ok': solve}[aux(x)](x)``, a comparison with a record aux kept
of itself) fails every run that changes aux's value, exactly as a main that builds on that value does.
So only what a program cannot produce without aux pays. For each held test the program passed, all
from the trusted side (the sandbox's judge calls the functions and decodes what they return; nothing
the program's process reports about itself decides anything):

1. *Rerun*: the program as graded runs the passed tests again in a fresh sandbox. A test counts only
   if it passes again with the same call and the same answer, so a main's own randomness earns
   nothing. Every call main makes of aux, in every run, goes through the same relay
   (``teamrl.sandbox.Program.relay``), which tells the judge its arguments and asks what to do.
2. *Aux alone*: in a fresh sandbox that holds the problem's preamble and the helper's code, without
   main's, aux is called with the arguments of each call main made of it in those tests, whatever
   aux's parameters are called: aux's answers, computed by the helper's code alone.
3. *Swapped answers*: the program as graded is called with a passed held test's own arguments while
   main's calls of aux return, in turn and without running aux, aux's answers to the calls main made
   for another call of the entry point; main must give the team's answer to that other call. The
   other call is another passed test (held or shown; the team's answer is the one it gave there), or,
   where the entry point takes several arguments, the test's own arguments with one of them taken
   from another held test (the team's answer is what the program as graded returns for them, called
   among the rerun's tests in an order drawn at random, so that it cannot tell these calls from the
   rerun). Up to three swaps of each kind (whole tests; one kind per argument position), each where
   aux answered otherwise than for the test itself.

The test is credited (counts in C) when, for one kind, main gives the team's answer on every swap; not
all of those answers are the test's own (else a main that ignores aux would pass); and not all of them
are one other value either, unless aux's answer holds main's (else a main that computes its answer
itself and, wherever aux disagrees with its own copy of aux, answers alike, a fixed None or its bool
flipped, would pass where the swaps' answers are all that value). Nothing is credited where aux
answered every call with its arguments as they came, or one of them (an aux that does nothing; a main
that computed the answer and passed it through aux). In every run the program's text is the same and
aux sits behind the same relay; the swapped run differs from the real one in aux's answers only, the
one thing measured. The helper's code runs alone in step 2 so that nothing main computes can be in
aux's answers: telling that run apart can only cost the program credit. Main is *thin* on a credited
test (it counts in T) when its answer is one of aux's answers or a part of one (an item or value at any
depth, or its text): ``return aux(x)[0]`` over an aux that returns ``(answer,)``, ``{'r': answer}``,
``str(answer)``, whatever aux's parameters are called and whoever calls it.

**What this bounds, beside the paper's definition.** The paper pays +0.5 for a passing test and a call
of aux, and +1.0 for a main that is more than a thin wrapper. Here both pay only for a held test whose
answer demonstrably came through aux's answers: given another call's aux answers, main gave that
call's answer. *Gating* -- main computes the answer itself and checks aux's value, in any way --
answers for its own test whatever aux says, so it earns no cooperation at all: no more than a correct
main without aux (2.5). A helper that solves the problem and a main that forwards its answer, however
wrapped, earn what the paper's thin wrapper earns (3.0). The price, paid by honest teams that black-box
probes cannot tell from gating: a main that needs both its own argument and aux's result (aux computes
a list's mean, main the deviations from it) is not credited, nor a main that calls aux once per item
of its input where no other test makes as many calls (aux's answers to another test do not fit its
calls); both earn what main alone earns. Where the entry point takes several arguments, a main that
uses one itself and gets what it needs of another from aux (aux sorts the numbers, main compares their
gaps with the threshold it was given) is credited through the swaps of that other argument. Out of
reach, documented rather than claimed: how much work turning aux's answers into main's is (a helper
that solves the problem and returns the answer in another form that main turns back earns the
non-wrapper part, as aux returning a list in the wrong order that main sorts does; an aux that returns
its input in another form, which main solves from, earns the cooperation parts, as aux parsing the
input for main does); an answer main computes from aux's answer by a rule that fits every test by
chance (where answers are bools, one swap in two on average; the more swaps, the rarer); and a program
that keeps notes across the calls of one sandbox to tell the live mixed calls of step 3 from the rerun.
The parts scale with C/N, so a team credited on one held test of ten earns a tenth of the bonus.

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
import dataclasses
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from teamrl.feedback.static import UnanalysableCode, parse_code
from teamrl.rewards.base import RewardResult
from teamrl.rewards.code_extract import Definition, ExtractedCode, extract_code, join_team_program
from teamrl.sandbox import Call, ExecutionRecord, Program, RecordedCall, SandboxPool, TestOutcome

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
        aux_alone: what measuring cooperation needs (:class:`AuxAlone`), when cooperation can pay at
            all (aux defined and returning, main calling it, both parsing).
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
    aux_alone: AuxAlone | None = None

    @property
    def syntax_ok(self) -> bool:
        """The joined program parses."""
        return self.syntax_error is None

    @property
    def needs_tests(self) -> bool:
        """The reward depends on running the tests (main is defined and the program parses)."""
        return self.main_defined and self.syntax_ok


@dataclass(frozen=True)
class AuxAlone:
    """How aux is run alone (module docstring, "Cooperation", step 2).

    Attributes:
        program: the helper's code alone (its imports and definitions, main's left out).
        parameters: the entry point's parameters that a call may fill by position, in order: they
            place a test's keyword arguments where aux takes them, whatever aux calls its own.
    """

    program: str
    parameters: tuple[str, ...]


@dataclass(frozen=True)
class CooperationProbe:
    """What aux contributes to the held tests the program passed (module docstring, "Cooperation").

    Attributes:
        passed: the held tests the program passed (indices into the held tests).
        contributed: those whose answer main provably built on aux's (C): credited.
        thin: those of ``contributed`` where main's answer is aux's answer or a part of it (T).
        rerun_record: the program's second run (the passed tests and the live mixed calls, in a random
            order); None where no swap could credit anything.
        aux_record: aux alone, answering the calls main made of it in the held and shown tests (module
            docstring, step 2); None where main made none.
        swap_record: main on held tests' arguments with aux answering as for other calls (step 3);
            None where no swap could credit anything (then no rerun was made either).
    """

    passed: tuple[int, ...]
    contributed: tuple[int, ...] = ()
    thin: tuple[int, ...] = ()
    rerun_record: ExecutionRecord | None = None
    aux_record: ExecutionRecord | None = None
    swap_record: ExecutionRecord | None = None


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


def positional_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """The parameters a call can fill by position, in order (no ``*args``, keyword-only or ``**``)."""
    return tuple(arg.arg for arg in function.args.posonlyargs + function.args.args)


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
    aux_alone = AuxAlone(join_team_program(aux_code, _NO_CODE, aux_name),
                         positional_parameters(main_node)) if cooperation_possible else None
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
        aux_alone=aux_alone,
    )


def cooperation_can_pay(analysis: CodeAnalysis, record: ExecutionRecord | None) -> bool:
    """The cooperation parts' gate: aux defined and returning, main calling it, a held test passed."""
    return analysis.aux_alone is not None and record is not None and record.passed > 0


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
            worked = 0 if analysis.main_is_thin_wrapper else len(set(probe.contributed) - set(probe.thin))
            parts["non_wrapper"] = NON_WRAPPER * worked / record.total
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


# ------------------------------------------------------------------------------------------------
# Measuring cooperation (module docstring): rerun, aux alone, swapped answers


#: Most swaps of one kind made for one held test (module docstring, step 3).
MAX_SWAPS = 3
#: Most other held tests one argument is taken from, for a test whose call has several.
MAX_DONORS = 4


def same_value(first: object, second: object) -> bool:
    """Plain data equal in type and value all the way down (``1``, ``1.0`` and ``True`` differ; a NaN
    equals a NaN): whether two recorded answers are the same answer."""
    if type(first) is not type(second):
        return False
    if isinstance(first, float):
        return first == second or (first != first and second != second)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(same_value(a, b) for a, b in zip(first, second))
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(same_value(first[key], second[key]) for key in first)
    return first == second


def _parts(value: object, depth: int = 0):
    """``value`` and every value inside it (items, dict keys and values), to a depth of 20."""
    yield value
    if depth < 20 and isinstance(value, (list, tuple, set, frozenset, dict)):
        items = [item for pair in value.items() for item in pair] if isinstance(value, dict) else value
        for item in items:
            yield from _parts(item, depth + 1)


def holds_answer(aux_answer: object, answer: object) -> bool:
    """Whether ``answer`` is ``aux_answer`` or a part of it (module docstring, "thin"), or the text of
    one (``'5'`` for 5) or one's value written as text (5 for ``'5'``)."""
    texts = {str(answer), repr(answer)}
    for part in _parts(aux_answer):
        if same_value(part, answer) or (isinstance(part, str) and part in texts):
            return True
        if isinstance(answer, str) and not isinstance(part, str) and answer in (str(part), repr(part)):
            return True
    return False


def _echoes(answer: object, call: RecordedCall) -> bool:
    """aux answered a call with its arguments as they came: all of them, or one of them (which is also
    how a main that computed the answer itself would pass it through aux as an argument)."""
    arguments = call.args + tuple(call.kwargs.values())
    return any(same_value(answer, kind(arguments)) for kind in (tuple, list)) \
        or any(same_value(answer, argument) for argument in arguments)


@dataclass(frozen=True, eq=False)
class _Observed:
    """A call of the entry point that passed (or, for mixed arguments, returned) and what it led to: its
    arguments as the test passed them, main's answer, and the calls main made of aux (None where they
    could not be recorded)."""

    shown: bool
    index: int
    args: tuple[object, ...]
    kwargs: dict[str, object]
    answer: object
    aux_calls: tuple[RecordedCall, ...] | None


def _one_call(outcome: TestOutcome, shown: bool = False) -> _Observed | None:
    """The test's one call of the entry point and its plain answer, where it passed and made exactly one."""
    calls = outcome.recorded_calls() if outcome.passed else None
    if calls is None or len(calls) != 1 or calls[0].raised:
        return None
    return _Observed(shown, outcome.index, calls[0].args, calls[0].kwargs, calls[0].result, outcome.relayed_calls())


def _by_position(call: _Observed, parameters: tuple[str, ...]) -> tuple[object, ...] | None:
    """The call's arguments by position, keyword arguments placed by the entry point's parameters; None
    where a keyword argument does not fill the next position."""
    positional, keywords = list(call.args), dict(call.kwargs)
    for name in parameters[len(positional):]:
        if name not in keywords:
            break
        positional.append(keywords.pop(name))
    return tuple(positional) if not keywords else None


def _same_call(first: _Observed | None, second: _Observed) -> bool:
    return first is not None and same_value(first.args, second.args) and same_value(first.kwargs, second.kwargs) \
        and same_value(first.answer, second.answer)


def _returned(record: ExecutionRecord | None, position: int) -> _Observed | None:
    """The Call test at ``position`` and what it returned, where it returned plain data."""
    return _one_call(record.tests[position]) if record is not None else None


@dataclass(frozen=True)
class _Swap:
    """One swapped-answer call for a target test: aux's answers to another call of the entry point are
    returned to main's calls of aux on the target's arguments. ``source`` is that other call: another
    test, or (``mixed`` set) the target's arguments with the one at position ``mixed`` taken from
    another held test, called live."""

    target: _Observed
    source: _Observed | None
    mixed: int | None = None
    arguments: tuple[object, ...] = ()


def _mixes(target: _Observed, tests: list[_Observed], parameters: tuple[str, ...]) -> list[_Swap]:
    """Where the entry point takes several arguments, the target's with one position taken from another
    held test (up to :data:`MAX_DONORS` of them), to be called live (module docstring, step 3)."""
    own = _by_position(target, parameters)
    if own is None or len(own) < 2:
        return []
    donors = [donor for donor in (_by_position(test, parameters) for test in tests
                                  if test is not target and not test.shown)
              if donor is not None and len(donor) == len(own)][:MAX_DONORS]
    return [_Swap(target, None, position, (*own[:position], other, *own[position + 1:]))
            for donor in donors for position, (mine, other) in enumerate(zip(own, donor))
            if not same_value(mine, other)]


def _chosen(swaps: list[_Swap], answers: dict[int, tuple[object, ...]]) -> list[_Swap]:
    """Of one kind of swap for a target (one ``mixed`` position, or whole tests), those to make: aux
    answered otherwise; one with the target's own answer if any, then one of each other answer, then
    any, up to :data:`MAX_SWAPS`. ``answers``: aux's answers by ``id`` of a call."""
    target = swaps[0].target
    useful = [swap for swap in swaps if not same_value(answers[id(swap.source)], answers[id(target)])]
    chosen = [swap for swap in useful if same_value(swap.source.answer, target.answer)][:1]
    for swap in useful:
        if not any(same_value(swap.source.answer, picked.source.answer) for picked in chosen):
            chosen.append(swap)
    chosen += [swap for swap in useful if swap not in chosen]
    return chosen[:MAX_SWAPS]


def _credited(target: _Observed, swaps: list[_Swap], returned: list[_Observed | None],
              aux_answers: tuple[object, ...]) -> bool:
    """Whether one kind of swap credits ``target`` (module docstring): main gave the team's answer to
    every swapped-in call; not all of them are the target's own answer; and they are not all one other
    value either (a main that answers every swap alike, its own bool flipped or a fixed None, would give
    them), unless aux's answer holds main's."""
    if not swaps or not all(result is not None and same_value(result.answer, swap.source.answer)
                            for swap, result in zip(swaps, returned)):
        return False
    answers = [swap.source.answer for swap in swaps]
    if all(same_value(answer, target.answer) for answer in answers):
        return False  # a main that ignored aux would have given them all
    varied = any(same_value(answer, target.answer) or not same_value(answer, answers[0]) for answer in answers)
    return varied or holds_answer(aux_answers, target.answer)


@dataclass(frozen=True)
class Measured:
    """A joint action whose cooperation is measured: its analysis, the records of its held and shown
    tests (made with the entry point recorded and aux relayed, see :func:`grade_team_code`), the held
    tests' Program (its code, setup and relay) and the shown test snippets."""

    analysis: CodeAnalysis
    held: ExecutionRecord
    shown: ExecutionRecord | None
    program: Program
    shown_tests: tuple[str, ...]


def measure_cooperation(items: Sequence[Measured], pool: SandboxPool) -> list[CooperationProbe]:
    """Measure what aux contributes to each item's passed held tests (module docstring, "Cooperation"):
    aux alone on the calls main made of it, then (where a swap could credit anything at all) the rerun,
    aux alone on the calls the rerun's mixed calls made, and the swapped answers; each program in a fresh
    sandbox, the items concurrently."""
    plans = [_Plan.first(item) for item in items]
    _wave(pool, [plan.alone(plan.tests) for plan in plans], [plan.read_alone for plan in plans])
    hopeful = [plan for plan in plans if plan.hopeful()]
    _wave(pool, [plan.rerun for plan in hopeful], [plan.read_rerun for plan in hopeful])
    _wave(pool, [plan.alone(plan.usable) for plan in hopeful], [plan.read_alone for plan in hopeful])
    _wave(pool, [plan.swapped() for plan in hopeful], [plan.read_swaps for plan in hopeful])
    return [plan.probe() for plan in plans]


def _wave(pool: SandboxPool, programs: Sequence[Program | None], readers: Sequence[Callable]) -> None:
    """Run the programs concurrently (None: nothing to run) and hand each reader its record (or None)."""
    for reader, record in zip(readers, _run_all(programs, pool)):
        reader(record)


class _Values:
    """Distinct plain-data keys in the order first added, compared by :func:`same_value`."""

    def __init__(self) -> None:
        self.keys: list[object] = []

    def add(self, key: object) -> None:
        if self.find(key) is None:
            self.keys.append(key)

    def find(self, key: object) -> int | None:
        return next((position for position, known in enumerate(self.keys) if same_value(known, key)), None)


class _Plan:
    """The measurement of one joint action, wave by wave (module docstring, "Cooperation")."""

    def __init__(self, item: Measured, tests: list[_Observed], mixed: list[_Swap]):
        self.item, self.tests, self.mixed = item, tests, mixed
        order = list(range(len(tests) + len(mixed)))
        secrets.SystemRandom().shuffle(order)  # the live mixed calls among the reruns, in no order the program knows
        self.order = order
        runs = tuple((item.shown_tests if tests[number].shown else item.program.tests)[tests[number].index]
                     if number < len(tests) else Call(item.program.record, mixed[number - len(tests)].arguments)
                     for number in order)
        self.rerun = dataclasses.replace(item.program, tests=runs)
        self.usable: list[_Observed] = []  # reproduced tests and answered mixes, each with its aux calls
        self.calls = _Values()  # every distinct call of aux main made among them
        self.answered: list[_Observed | None] = []  # aux alone's answer to each of ``calls``
        self.asked = 0  # how many of ``calls`` the last aux-alone run was asked
        self.kinds: list[list[_Swap]] = []
        self.records: dict[str, ExecutionRecord | None] = {"rerun": None, "aux": None, "swap": None}

    @classmethod
    def first(cls, item: Measured) -> _Plan:
        tests = [test for record, shown in ((item.held, False), (item.shown, True)) if record is not None
                 for test in (_one_call(outcome, shown) for outcome in record.tests) if test is not None]
        parameters = item.analysis.aux_alone.parameters
        return cls(item, tests, [swap for test in tests if not test.shown for swap in _mixes(test, tests, parameters)])

    def alone(self, calls: list[_Observed]) -> Program | None:
        """aux alone, in the helper's code alone, answering the calls of aux that ``calls`` made and no
        earlier run answered (None: none)."""
        self.asked = len(self.calls.keys)
        for call in calls:
            for aux_call in call.aux_calls or ():
                self.calls.add((aux_call.args, aux_call.kwargs))
        item = self.item
        new = tuple(Call(item.program.relay, args, kwargs) for args, kwargs in self.calls.keys[self.asked:])
        return Program(_with_preamble(item.program.setup, item.analysis.aux_alone.program), new,
                       setup=item.program.setup, relay=item.program.relay) if new else None

    def read_alone(self, record: ExecutionRecord | None) -> None:
        if self.records["aux"] is None:  # the probe keeps the run on the calls of the tests themselves
            self.records["aux"] = record
        self.answered += [_returned(record, position) for position in range(len(self.calls.keys) - self.asked)]

    def answers(self, call: _Observed) -> tuple[object, ...] | None:
        """aux alone's answers to the calls ``call`` made of aux, in order; None where it made none or aux
        gave no plain answer to one."""
        positions = [self.calls.find((aux_call.args, aux_call.kwargs)) for aux_call in call.aux_calls or ()]
        if not positions or any(position is None or self.answered[position] is None for position in positions):
            return None
        return tuple(self.answered[position].answer for position in positions)

    def hopeful(self) -> bool:
        """Whether a swap could credit anything: aux answered some call otherwise than with its own
        arguments, and a held test has another call to swap with (another aux answer, or mixed ones)."""
        echoes = [_echoes(self.answered[self.calls.find((aux_call.args, aux_call.kwargs))].answer, aux_call)
                  for call in self.tests if self.answers(call) is not None for aux_call in call.aux_calls]
        if all(echoes):
            return False  # aux only ever handed its arguments back: it did nothing main built on
        answered = [call for call in self.tests if self.answers(call) is not None]
        return any(any(not same_value(self.answers(other), self.answers(target)) for other in answered)
                   or any(swap.target is target for swap in self.mixed)
                   for target in answered if not target.shown)

    def read_rerun(self, record: ExecutionRecord | None) -> None:
        """Keep the tests that passed again with the same call and answer, and the mixes answered live."""
        self.records["rerun"] = record
        again = {number: _returned(record, position) for position, number in enumerate(self.order)}
        self.usable = [test for number, test in enumerate(self.tests) if _same_call(again[number], test)]
        for number, swap in enumerate(self.mixed):
            live = again[len(self.tests) + number]
            if live is not None:
                self.usable.append(live)
                self.mixed[number] = dataclasses.replace(swap, source=live)

    def swapped(self) -> Program | None:
        """The program as graded, called on each target's arguments with aux answering as for the swap
        (None: no swap worth making)."""
        answers = {id(call): self.answers(call) for call in self.usable}
        answers = {key: value for key, value in answers.items() if value is not None}
        for target in (call for call in self.usable if id(call) in answers and call in self.tests and not call.shown):
            whole = [_Swap(target, source) for source in self.tests
                     if source is not target and id(source) in answers]
            mixed = [swap for swap in self.mixed if swap.target is target and id(swap.source) in answers]
            for kind in [whole] + [[swap for swap in mixed if swap.mixed == position]
                                   for position in dict.fromkeys(swap.mixed for swap in mixed)]:
                chosen = _chosen(kind, answers) if kind else []
                if chosen:
                    self.kinds.append(chosen)
        calls = tuple(Call(self.item.program.record, swap.target.args, swap.target.kwargs,
                           relay=self.answers(swap.source)) for kind in self.kinds for swap in kind)
        return dataclasses.replace(self.item.program, record=None, tests=calls) if calls else None

    def read_swaps(self, record: ExecutionRecord | None) -> None:
        self.records["swap"] = record

    def probe(self) -> CooperationProbe:
        """The credited and thin held tests, from the swapped run."""
        credited, thin, position = set(), set(), 0
        for kind in self.kinds:
            returned = [_returned(self.records["swap"], position + offset) for offset in range(len(kind))]
            position += len(kind)
            target = kind[0].target
            if _credited(target, kind, returned, self.answers(target)):
                credited.add(target.index)
                if holds_answer(self.answers(target), target.answer):
                    thin.add(target.index)
        return CooperationProbe(passed=tuple(outcome.index for outcome in self.item.held.tests if outcome.passed),
                                contributed=tuple(sorted(credited)), thin=tuple(sorted(thin)),
                                rerun_record=self.records["rerun"], aux_record=self.records["aux"],
                                swap_record=self.records["swap"])


def grade_team_code(aux_completions: Sequence[str], main_completions: Sequence[str],
                    entry_points: Sequence[str], tests: Sequence[Sequence[str]], pool: SandboxPool,
                    aux_name: str = "aux", preambles: Sequence[str] | None = None,
                    shown_tests: Sequence[Sequence[str]] | None = None) -> list[CodeGrade]:
    """Analyse, run (concurrently, only where needed) and score a batch of joint actions.

    Item ``i`` is the helper's ``aux_completions[i]`` with the main agent's ``main_completions[i]``
    for the problem with ``entry_points[i]``, graded on the held test snippets ``tests[i]`` (see
    ``teamrl.sandbox.Program``; ``teamrl.sandbox.humaneval_tests`` makes them from HumanEval).
    ``shown_tests[i]`` run for feedback only (``CodeGrade.shown_record``), in sandboxes of their own
    that have all ended before any held test starts, so nothing a held test's run does can reach what
    feedback shows; they earn nothing. ``preambles[i]`` (the problem's own imports and helpers, e.g.
    HumanEval prompts' ``poly``) is placed before the agents' code in the program the tests run; it
    earns no reward. Where cooperation can pay, it is measured (:func:`measure_cooperation`).
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

    def program(analysis: CodeAnalysis, entry: str, snippets: Sequence[str], preamble: str) -> Program | None:
        if not (analysis.needs_tests and snippets):
            return None
        measured = analysis.aux_alone is not None
        return Program(_with_preamble(preamble, analysis.program), tuple(snippets), setup=preamble,
                       relay=aux_name if measured else None, record=entry if measured else None)

    held = [program(*item) for item in zip(analyses, entry_points, tests, preambles)]
    shown = [program(*item) for item in zip(analyses, entry_points, shown_tests, preambles)]
    shown_records = _run_all(shown, pool)
    held_records = _run_all(held, pool)
    to_probe = [index for index, (analysis, record) in enumerate(zip(analyses, held_records))
                if cooperation_can_pay(analysis, record)]
    measured = measure_cooperation([Measured(analyses[i], held_records[i], shown_records[i], held[i],
                                             tuple(shown_tests[i])) for i in to_probe], pool)
    probes: list[CooperationProbe | None] = [None] * count
    for index, probe in zip(to_probe, measured):
        probes[index] = probe
    return [CodeGrade(analysis=analysis, record=record, reward=code_reward(analysis, record, probe),
                      shown_record=shown_record, probe=probe)
            for analysis, record, shown_record, probe in zip(analyses, held_records, shown_records, probes)]


def _run_all(programs: Sequence[Program | None], pool: SandboxPool) -> list[ExecutionRecord | None]:
    """Each program's record (None where there is none), all run concurrently, all ended on return."""
    futures = [pool.submit(program) if program is not None else None for program in programs]
    return [future.result() if future is not None else None for future in futures]


def _with_preamble(preamble: str, program: str) -> str:
    return f"{preamble}\n\n{program}" if preamble.strip() else program
