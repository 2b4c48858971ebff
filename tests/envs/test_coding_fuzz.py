"""Hostile completions in multi-turn coding rollouts (issue #37 item 5).

``CodingEnv.next_observations`` gives every agent feedback whatever the team wrote: text too deep,
too long or not text at all is named in a feedback line, and a producer that still fails on a
completion leaves a line saying so (and a logged warning) instead of ending the run. The partner's code
below never parses, so no program reaches the sandbox and these tests run without bubblewrap.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import teamrl.envs.coding as coding
from teamrl.config import AlgorithmConfig
from teamrl.envs import Step, make_env
from teamrl.rollout.tree import sample_tree

FAST_LIMITS = {"test_timeout_s": 1.0, "program_timeout_s": 3.0, "cpu_time_s": 1, "memory_bytes": 256 << 20}
ENTRY = "separate_paren_groups"  # HumanEval/1, the one training problem of limit=2, eval_size=1
BROKEN = {0: "def aux(x):\n    return x +\n", 1: f"def {ENTRY}(x):\n    return x +\n"}


def body(seat: int, expression: str) -> str:
    """A definition of the seat's function returning ``expression``."""
    return f"def {'aux' if seat == 0 else ENTRY}(x):\n    return {expression}\n"


#: name: (the seat's completion, what its feedback line says: a regular expression).
HOSTILE = {
    "the issue's 500 unary minus signs": (lambda seat: body(seat, "-" * 500 + "x"),
                                          r"The code could not be analysed: TooDeep \(its syntax tree is more"),
    "10,000 unary minus signs": (lambda seat: body(seat, "-" * 10_000 + "x"),
                                 r"The code could not be analysed: MemoryError \(nested too deeply"),
    "5,000-long attribute chain": (lambda seat: body(seat, "x" + ".a" * 5_000),
                                   r"The code could not be analysed: (RecursionError|TooDeep)"),
    "x+x+... 3,000 terms": (lambda seat: body(seat, "+".join(["x"] * 3_000)),
                            r"The code could not be analysed: (RecursionError|TooDeep)"),
    "comprehension with 50,000 for clauses": (lambda seat: body(seat, "[x " + "for x in x " * 50_000 + "]"),
                                              r"The code could not be analysed: TooLong \(550,0\d\d characters"),
    "NUL bytes": (lambda seat: body(seat, "x\0"), r"SyntaxError: source code string cannot contain null bytes"),
    "lone surrogate": (lambda seat: body(seat, "'\ud800'"), r"SyntaxError: 'utf-8' codec can't encode"),
    "binary garbage": (lambda seat: bytes(range(256)).decode("latin-1") * 40,
                       r"No Python function definition was found in your answer\."),
    "a 1 MB function": (lambda seat: body(seat, "+".join(["x"] * 500_000)),
                        r"The code could not be analysed: TooLong \(1,000,0\d\d characters"),
}


@pytest.fixture(scope="module")
def env():
    env = make_env("humaneval", limit=2, eval_size=1, sandbox_workers=1, sandbox_limits=FAST_LIMITS)
    yield env
    env.close()


def next_observations(env, actions):
    item = env.items("train")[0]
    step = Step(tuple(env.observe(item)), tuple(actions), env.joint_reward(item, actions))
    return env.next_observations(item, [step])


def feedback(observation: str) -> str:
    return observation.split("Feedback on your previous answer:\n", 1)[1]


@pytest.mark.parametrize("seat", [0, 1], ids=["helper", "main"])
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_completions_get_a_feedback_line(env, name, seat):
    write, expected = HOSTILE[name]
    actions = [BROKEN[0], BROKEN[1]]
    actions[seat] = write(seat)
    observations = next_observations(env, actions)
    assert re.search("^- " + expected, feedback(observations[seat]), re.MULTILINE), feedback(observations[seat])[:400]
    assert "- SyntaxError at line 2, column 15: invalid syntax\n" in feedback(observations[1 - seat])


def test_a_producer_failing_on_hostile_text_leaves_a_feedback_line_and_a_warning(env, monkeypatch, caplog):
    def overflows(source, known_names=()):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(coding, "analyze_code", overflows)
    with caplog.at_level(logging.WARNING, logger="teamrl.feedback"):
        observations = next_observations(env, [BROKEN[0], body(1, "aux(x)")])
    for observation in observations:
        assert "- Your code could not be analysed: RecursionError (maximum recursion depth exceeded).\n" \
               in feedback(observation)
    assert [record.getMessage() for record in caplog.records] == [
        f"feedback on seat {seat}'s completion failed: RecursionError" for seat in (0, 1)]
    assert all(record.exc_info is not None for record in caplog.records)  # the traceback is logged


def test_a_bug_in_a_producer_is_not_hidden_as_feedback(env, monkeypatch):
    monkeypatch.setattr(coding, "analyze_code", lambda source, known_names=(): None)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'ok'"):
        next_observations(env, [BROKEN[0], body(1, "aux(x)")])


WRAPPERS = [("(", ")"), ("[", "]"), ("-", ""), ("not ", ""), ("lambda: ", ""), ("", ".a"), ("", "()"), ("x+", ""),
            ("x if x else ", ""), ("f'{", "}'"), ("[x for x in ", "]")]
COMPLETIONS = st.one_of(
    st.builds(lambda wrapper, depth, seat: (seat, body(seat, wrapper[0] * depth + "x" + wrapper[1] * depth)),
              st.sampled_from(WRAPPERS), st.one_of(st.integers(0, 400), st.integers(400, 12_000)), st.integers(0, 1)),
    st.tuples(st.integers(0, 1), st.text(st.characters(exclude_categories=()), max_size=1_000)),
    st.tuples(st.integers(0, 1), st.binary(max_size=2_000).map(lambda data: data.decode("latin-1"))),
)


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(COMPLETIONS)
def test_next_observations_answer_any_completion(env, seat_and_text):
    seat, text = seat_and_text
    actions = [BROKEN[0], BROKEN[1]]
    actions[seat] = text
    observations = next_observations(env, actions)
    assert len(observations) == 2 and all(feedback(observation) for observation in observations)


def scripted_sampler(rows_per_turn):
    """A SampleFn whose agent i writes rows_per_turn[turn][i][g] as its g-th sample at every expansion point."""
    turns = iter(rows_per_turn)

    def sample(observations, num_samples, seed):
        rows, points = next(turns), len(observations[0])
        return [SimpleNamespace(texts=list(rows[i]) * points,
                                completion_ids=torch.zeros(points * num_samples, 1, dtype=torch.long))
                for i in range(len(observations))]

    return sample


def test_a_two_turn_rollout_of_hostile_completions_completes_with_feedback_on_them(env):
    deep_aux = HOSTILE["5,000-long attribute chain"][0](0)
    deep_main = HOSTILE["the issue's 500 unary minus signs"][0](1)
    garbage = HOSTILE["binary garbage"][0](1)
    first_turn = ((deep_aux, BROKEN[0]), (deep_main, garbage))  # aligned: (deep_aux, deep_main), (BROKEN, garbage)
    second_turn = ((BROKEN[0], BROKEN[0]), (BROKEN[1], BROKEN[1]))
    config = AlgorithmConfig(num_generations=2, num_turns=2)
    tree = sample_tree(scripted_sampler([first_turn, second_turn]), env, env.items("train"), config)
    assert len(tree.turns) == 2 and tree.turns[1].rewards.shape == (2, 2, 1)
    (deep_helper_obs, deep_main_obs), (_, garbage_obs) = tree.turns[1].observations
    assert re.search(r"^- The code could not be analysed: (RecursionError|TooDeep)", feedback(deep_helper_obs),
                     re.MULTILINE)
    assert "- The code could not be analysed: TooDeep (its syntax tree is more than 100 levels deep)." \
           in feedback(deep_main_obs)
    assert "- No Python function definition was found in your answer." in feedback(garbage_obs)
