"""Held tests stay held across turns: nothing a held test's run does or decides reaches the feedback.

Two multi-turn attacks, each played through ``CodingEnv`` as training plays it (grade, feedback, next
turn): a *leak* (turn 1 answers each call with the arguments of earlier calls in its sandbox, so that
the failing shown tests' ``actual`` values carry the held tests' inputs; turn 2 hard-codes answers for
what the feedback showed) and a *count oracle* (each turn changes the answers for one group of inputs
and keeps the change if the feedback's count of passing held tests rose). Each earns nothing over the
same program without the attack.
"""

from __future__ import annotations

import ast
import json
import re
import shutil

import pytest

from teamrl.envs import make_env
from teamrl.envs.base import Step
from teamrl.envs.coding import HumanEvalEnv
from teamrl.rewards.base import RewardResult

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

HELPER = "def aux(*args):\n    return 0\n"
# Turn 1 of the leak: every call answers with arguments of earlier calls in this sandbox not shown yet (as
# many as fit in what feedback shows of a value), and notes its own.
RECORDER = '''import json
import os


def {entry}(*args):
    path = "teamrl-calls.json"
    seen = json.load(open(path)) if os.path.exists(path) else {{"calls": [], "shown": 0}}
    batch = []
    while seen["shown"] < len(seen["calls"]) and len(repr(batch + [seen["calls"][seen["shown"]]])) < 190:
        batch.append(seen["calls"][seen["shown"]])
        seen["shown"] += 1
    try:
        seen["calls"].append(json.loads(json.dumps(list(args))))
    except (TypeError, ValueError):
        pass
    json.dump(seen, open(path, "w"))
    return batch
'''
ACTUAL = re.compile(r"^\s*actual:\s+(.*)$", re.MULTILINE)
# Each turn of the oracle: the answer to a call is a candidate chosen for the call's group of inputs.
CANDIDATES = (False, True, 0, 1, None, [], "")
GROUPS = 4
ORACLE = '''import json


class _Choice:
    values = {choice!r}


def {entry}(*args):
    group = sum(map(ord, json.dumps(list(args), default=repr))) % {groups}
    return {candidates!r}[_Choice.values[group]]
'''
HELD_COUNT = re.compile(r"(\d+) of (\d+) passed")


@pytest.fixture(scope="module")
def humaneval():
    env = make_env("humaneval", sandbox_limits={"test_timeout_s": 5.0, "program_timeout_s": 20.0})
    yield env
    env.close()


def _items(env: HumanEvalEnv, ids: list[str] | None) -> list[dict]:
    items = [item for split in ("eval", "train") for item in env.items(split)]
    return [item for item in items if ids is None or item["id"] in ids]


def _feedback(env: HumanEvalEnv, item: dict, actions: tuple[str, str]) -> str:
    """The main agent's next observation after ``actions`` (the feedback both agents get on the tests)."""
    reward = env.joint_reward(item, actions)
    return env.next_observations(item, [Step(env.observe(item), actions, reward)])[1]


def _leaked(observation: str) -> set[str]:
    """The call arguments (as JSON) that the ``actual:`` values of a feedback show."""
    found = set()
    for value in ACTUAL.findall(observation):
        try:
            batch = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # cut short by the feedback's length limit
            continue
        if isinstance(batch, list):
            found.update(json.dumps(arguments) for arguments in batch if isinstance(arguments, list))
    return found


def _hard_coded(item: dict, known: set[str]) -> str:
    """Turn 2 of the leak: the canonical solution (as ``_solve``) answers the calls whose arguments the
    feedback showed, None the others."""
    module = ast.parse(item["reference"])
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef) and node.name == item["entry_point"]:
            node.name = "_solve"
        elif isinstance(node, ast.Name) and node.id == item["entry_point"]:
            node.id = "_solve"
    return (ast.unparse(module) + "\n\n\nclass _Known:\n    calls = " + repr(frozenset(known)) + "\n\n\n"
            + f"def {item['entry_point']}(*args):\n"
            "    import json\n    return _solve(*args) if json.dumps(list(args)) in _Known.calls else None\n")


def _leak(env: HumanEvalEnv, items: list[dict]) -> tuple[list[RewardResult], list[RewardResult], int]:
    """Turn 2's rewards after the leak's turn 1, the same turn 2 knowing nothing, and how many calls the
    turn-1 feedback showed."""
    known = [_leaked(_feedback(env, item, (HELPER, RECORDER.format(entry=item["entry_point"])))) for item in items]
    attack = env.joint_rewards([(item, (HELPER, _hard_coded(item, calls)), ()) for item, calls in zip(items, known)])
    honest = env.joint_rewards([(item, (HELPER, _hard_coded(item, set())), ()) for item in items])
    return attack, honest, sum(map(len, known))


def _oracle(env: HumanEvalEnv, items: list[dict], turns: int) -> tuple[list[float], list[float]]:
    """Each item's tests part at turn 1 and after ``turns`` turns of the count oracle (a change kept only
    when the feedback's count of passing held tests rose; where the feedback counts none, none is kept)."""
    choices = [[0] * GROUPS for _ in items]

    def program(item, choice):
        return ORACLE.format(entry=item["entry_point"], choice=choice, groups=GROUPS, candidates=CANDIDATES)

    def counted(item, choice):
        held = [int(passed) for passed, _ in HELD_COUNT.findall(_feedback(env, item, (HELPER, program(item, choice))))]
        return held[-1] if held else None

    first = [env.joint_reward(item, (HELPER, program(item, choice))).parts["tests"]
             for item, choice in zip(items, choices)]
    best = [counted(item, choice) for item, choice in zip(items, choices)]
    for turn in range(turns - 1):
        for number, item in enumerate(items):
            trial = list(choices[number])
            trial[turn % GROUPS] = (trial[turn % GROUPS] + 1) % len(CANDIDATES)
            count = counted(item, trial)
            if count is not None and best[number] is not None and count > best[number]:
                choices[number], best[number] = trial, count
    last = [env.joint_reward(item, (HELPER, program(item, choice))).parts["tests"]
            for item, choice in zip(items, choices)]
    return first, last


def _shown_calls(item: dict) -> set[str]:
    """The arguments (as JSON) of the entry point's calls in the shown tests."""
    calls = set()
    for label in item["shown_test_labels"]:
        for node in ast.walk(ast.parse(label)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == item["entry_point"]:
                calls.add(json.dumps([ast.literal_eval(argument) for argument in node.args]))
    return calls


def test_the_feedback_is_the_same_whatever_the_held_tests_gave(humaneval):
    """Two mains that both fail the shown tests alike, one passing every held test and one none: their
    feedback is the same text, so it carries nothing of the held tests (not one bit a turn)."""
    item = _items(humaneval, ["HumanEval/0"])[0]
    right = item["reference"].replace("def has_close_elements(", "def _right(")

    def main(flip_held: bool) -> str:
        return right + ("\n\ndef has_close_elements(*args):\n    import json\n    answer = _right(*args)\n"
                        f"    shown = json.dumps(list(args)) in {_shown_calls(item)!r}\n"
                        f"    return not answer if shown or {flip_held} else answer\n")

    grades = [humaneval.grade(item, ("", main(flip))) for flip in (True, False)]
    assert [(grade.record.passed, grade.shown_record.passed) for grade in grades] == [(0, 0), (5, 0)]
    failing, passing = (_feedback(humaneval, item, ("", main(flip))).split("Feedback on your previous answer:")[1]
                        for flip in (True, False))
    assert failing == passing and "Hidden tests" in failing and "2 of 2 tests failed" in failing


def test_a_leak_of_held_inputs_through_feedback_earns_nothing(humaneval):
    """HumanEval/0-3: the feedback shows only the shown tests' own calls, which turn 2 cannot use."""
    items = _items(humaneval, [f"HumanEval/{number}" for number in range(4)])
    attack, honest, _ = _leak(humaneval, items)
    assert [reward.parts["tests"] for reward in attack] == [reward.parts["tests"] for reward in honest]


def test_a_count_oracle_learns_nothing_across_turns(humaneval):
    items = _items(humaneval, ["HumanEval/0", "HumanEval/3"])
    first, last = _oracle(humaneval, items, turns=3)
    assert last == first


@pytest.mark.slow
def test_the_leak_on_every_humaneval_problem(humaneval):
    """Issue #51's measurement: with held tests run first in the shown tests' sandbox, this leak showed
    547 of the 618 held inputs and turn 2 passed 0.922 of the held tests against 0.053."""
    items = _items(humaneval, None)
    attack, honest, shown = _leak(humaneval, items)
    gained = {item["id"]: (a.parts["tests"], h.parts["tests"]) for item, a, h in zip(items, attack, honest)
              if a.parts["tests"] > h.parts["tests"]}
    print(f"leak | calls shown {shown} | tests part {sum(a.parts['tests'] for a in attack) / len(items):.3f} "
          f"against {sum(h.parts['tests'] for h in honest) / len(items):.3f} | {len(gained)} problems ahead")
    assert gained == {}, (len(gained), shown)


@pytest.mark.slow
def test_the_count_oracle_on_every_humaneval_problem(humaneval):
    items = _items(humaneval, None)
    first, last = _oracle(humaneval, items, turns=6)
    print(f"count oracle | tests part {sum(last) / len(items):.3f} after 6 turns against {sum(first) / len(items):.3f}")
    assert sum(last) <= sum(first), (sum(first) / len(items), sum(last) / len(items))
