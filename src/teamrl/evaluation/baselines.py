"""Prompt-only baselines: the same task, models and sampling as a team, but no joint training.

Each baseline is a small function registered by name in :data:`BASELINES`, called as
``baseline(env, team, items, num_samples)``: it produces ``num_samples`` joint actions per item
(item-major, as :func:`teamrl.inference.run_team` lays out rows) for the environment's own
:meth:`~teamrl.envs.base.Environment.joint_reward` to score, and counts the tokens it generated and the
wall-clock seconds it took. Every generation goes through ``run_team``, so agents that share a base
run in one mixed-adapter batch and agents on different models run concurrently.

What each agent sees:

* ``single``: one model (the team's first agent's, or another one the caller puts in ``team``) does
  every seat's part from one prompt (:meth:`~teamrl.envs.base.Environment.single_agent_observation`,
  under the environment's ``single_agent_role``); its answer is split into the joint action by
  :meth:`~teamrl.envs.base.Environment.split_single_agent_output`. It samples like agent 0 but gets the
  whole team's token budget (``num_agents`` times ``max_new_tokens``), as it writes every part.
* ``concat``: naive concatenation. Every agent answers its own observation, in parallel, and the answers
  are the joint action: decentralised execution of an untrained team. A trained team runs the same way
  (``team:PATH`` in ``teamrl eval``): only the training differs.
* ``sequential``: a pipeline. Agent 0 answers its observation; agent i then sees its observation with
  the answers of agents 0..i-1 (:meth:`~teamrl.envs.base.Environment.teammates_observation`). Agents
  wait for each other, so latencies add up.
* ``discussion``: one round of discussion. Every agent answers its observation (as ``concat``); then
  each sees its observation, its own first answer and the others' first answers, and revises. The
  revised answers are the joint action.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from teamrl.envs.base import Environment, Item, Step
from teamrl.envs.centralized import CentralizedEnv
from teamrl.envs.checks import first_observations
from teamrl.inference import TeamOutput, run_team
from teamrl.registry import BASELINES
from teamrl.team import Team

T = TypeVar("T")


@dataclass
class Episode:
    """One joint action a method produced for an item, and what led to it."""

    item: Item
    observations: list[str]
    """What each agent saw when it wrote its part of ``actions`` (a single agent: its one prompt)."""
    actions: list[str]
    """The joint action the environment scores, one completion per seat."""
    trace: dict[str, Any] = field(default_factory=dict)
    """What else the method did: a single agent's whole ``completion``; a discussion's
    ``first_observations`` and ``first_answers``."""
    history: tuple[Step, ...] = ()
    """The episode's earlier turns (a multi-turn held-out episode): ``observations`` and ``actions`` are its
    last turn's, and its return is every turn's joint reward summed."""


@dataclass
class MethodOutput:
    """A method's joint actions for a batch of items, with its cost."""

    episodes: list[Episode]
    """``num_samples`` consecutive episodes per item, items in order."""
    tokens: int
    """Tokens generated, every agent and round together."""
    seconds: float
    """Wall-clock time of all generation (agents of one round concurrently, rounds one after another)."""


Baseline = Callable[[Environment, Team, Sequence[Item], int], MethodOutput]
register_baseline = BASELINES.register
"""``@register_baseline(name)``: make a baseline selectable by name in ``teamrl eval --methods``."""


def _repeat(values: Iterable[T], times: int) -> list[T]:
    """Each value ``times`` times in a row: the row layout of ``run_team(..., num_samples=times)``."""
    return [value for value in values for _ in range(times)]


def _joint_actions(output: TeamOutput) -> list[list[str]]:
    """Row-major joint actions from ``run_team``'s agent-major texts."""
    return [list(actions) for actions in zip(*output.texts)]


@register_baseline("single")
def single(env: Environment, team: Team, items: Sequence[Item], num_samples: int) -> MethodOutput:
    """One model does every seat's part from one prompt; its answer is split into the joint action."""
    first = team[0]
    agent = replace(first, name="single", system_prompt=env.single_agent_role,
                    sampling=replace(first.sampling, max_new_tokens=first.sampling.max_new_tokens * env.num_agents))
    central = CentralizedEnv(env)  # the task as one agent plays it, as a centralised policy is trained on it
    observations = first_observations(central, items)
    output = run_team(Team([agent]), observations, num_samples)
    episodes = [Episode(item, seen, [text])
                for (item, seen), text in zip(_repeat(zip(items, observations), num_samples), output.texts[0])]
    return as_inner_joint_actions(central, MethodOutput(episodes, output.tokens, output.seconds))


def as_inner_joint_actions(central: CentralizedEnv, output: MethodOutput) -> MethodOutput:
    """A centralised policy's ``output`` (one completion per episode) as the joint actions of the task it plays
    (every seat's part, the one agent's whole completion in the trace), as the prompt-only single-agent baseline
    records them: the task then scores them as it scores a team's."""
    episodes = [replace(episode, actions=central.inner_actions(episode.item, episode.actions),
                        trace={**episode.trace, "completion": episode.actions[0]})
                for episode in output.episodes]
    return replace(output, episodes=episodes)


@register_baseline("concat")
def concat(env: Environment, team: Team, items: Sequence[Item], num_samples: int) -> MethodOutput:
    """Every agent answers its own observation in parallel; the answers are the joint action."""
    observations = first_observations(env, items)
    output = run_team(team, observations, num_samples)
    episodes = [Episode(item, seen, actions) for (item, seen), actions
                in zip(_repeat(zip(items, observations), num_samples), _joint_actions(output))]
    return MethodOutput(episodes, output.tokens, output.seconds)


@register_baseline("sequential")
def sequential(env: Environment, team: Team, items: Sequence[Item], num_samples: int) -> MethodOutput:
    """Agent i answers after agents 0..i-1 and sees their answers."""
    rows = _repeat(zip(items, first_observations(env, items)), num_samples)
    answers: list[list[str]] = [[] for _ in rows]
    seen: list[list[str]] = [[] for _ in rows]
    tokens, seconds = 0, 0.0
    for seat, agent in enumerate(team):
        observations = [env.teammates_observation(item, seat, first[seat], list(enumerate(earlier))) if earlier
                        else first[seat] for (item, first), earlier in zip(rows, answers)]
        output = run_team(Team([agent]), [[observation] for observation in observations])
        tokens, seconds = tokens + output.tokens, seconds + output.seconds
        for row, (observation, text) in enumerate(zip(observations, output.texts[0])):
            seen[row].append(observation)
            answers[row].append(text)
    episodes = [Episode(item, observations, actions)
                for (item, _), observations, actions in zip(rows, seen, answers)]
    return MethodOutput(episodes, tokens, seconds)


@register_baseline("discussion")
def discussion(env: Environment, team: Team, items: Sequence[Item], num_samples: int) -> MethodOutput:
    """Every agent answers, then revises after seeing the others' first answers."""
    observations = first_observations(env, items)
    first = run_team(team, observations, num_samples)
    rows = _repeat(zip(items, observations), num_samples)
    first_answers = _joint_actions(first)
    revised = [[env.teammates_observation(item, seat, seen[seat],
                                          [(other, text) for other, text in enumerate(answers) if other != seat],
                                          own=answers[seat])
                for seat in range(len(team))]
               for (item, seen), answers in zip(rows, first_answers)]
    second = run_team(team, revised)
    episodes = [Episode(item, observations, actions, {"first_observations": seen, "first_answers": answers})
                for (item, seen), observations, answers, actions
                in zip(rows, revised, first_answers, _joint_actions(second))]
    return MethodOutput(episodes, first.tokens + second.tokens, first.seconds + second.seconds)
