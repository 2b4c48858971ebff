"""Checks on what a task's own code returns, where it enters teamrl.

A task's :meth:`~teamrl.envs.base.Environment.observe`, ``next_observations``, ``joint_reward(s)`` and
``individual_rewards(_many)`` are the user's code. What they return goes on to the model's prompts, the
advantages and the optimiser: a missing observation fails deep inside the rollout, an extra one is
dropped without a word, and a NaN reward turns every weight into NaN. Every place teamrl calls them
passes the result through one of these functions, which returns it unchanged or raises
:class:`EnvironmentOutputError` with one line naming the task's method, the item and the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from teamrl.envs.base import Environment, Item, Step
from teamrl.envs.centralized import CentralizedEnv
from teamrl.rewards.base import RewardResult
from teamrl.user_code import OneLineError

#: Longest repr of a returned value an error message quotes.
MAX_VALUE_CHARS = 160

#: The batch methods whose base-class default only calls the one-at-a-time method a task writes.
_ONE_AT_A_TIME = {"joint_rewards": "joint_reward", "individual_rewards_many": "individual_rewards"}

Request = tuple[Item, Sequence[str], Sequence[Step]]


class EnvironmentOutputError(OneLineError):
    """A task's method returned something teamrl cannot use (the wrong type or number of values, or a
    non-finite number). A ValueError, so ``teamrl`` reports it as ``teamrl: error: ...``."""


def user_function(env: Environment, method: str) -> str:
    """``Class.method`` of the code a call of ``env.method`` runs: the batch method a task overrides, or else
    the one-at-a-time method the base class's batch default calls; for a :class:`CentralizedEnv`, its inner
    task's (whose single-agent prompt is the one agent's observation)."""
    if isinstance(env, CentralizedEnv):
        if method == "observe":
            return f"{type(env.inner).__name__}.single_agent_observation"
        env = env.inner
    named = env.function_behind(method)
    if named is not None:
        return named
    single = _ONE_AT_A_TIME.get(method)
    if single is not None and getattr(type(env), method) is getattr(Environment, method):
        method = single
    return f"{type(env).__name__}.{method}"


def checked_observations(env: Environment, method: str, item: Item, observations: Any) -> list[str]:
    """``observations``, which ``env.method(item, ...)`` returned ('observe' or 'next_observations'), as a list
    if it is a sequence of ``env.num_agents`` strings."""
    if (isinstance(observations, str) or not isinstance(observations, Sequence)
            or len(observations) != env.num_agents or not all(isinstance(o, str) for o in observations)):
        raise EnvironmentOutputError(
            f"{user_function(env, method)} returned {short_repr(observations)} for {_item(item)}; it must return a "
            f"list of {env.num_agents} strings, one observation per agent")
    return list(observations)


def first_observations(env: Environment, items: Sequence[Item]) -> list[list[str]]:
    """Each item's first observations, ``env.observe(item)`` checked (:func:`checked_observations`): what
    every evaluation and ``teamrl generate`` prompts the agents with."""
    return [checked_observations(env, "observe", item, env.observe(item)) for item in items]


def checked_reward(env: Environment, item: Item, result: Any, method: str = "joint_reward") -> RewardResult:
    """``result``, which ``env.method`` returned for ``item``, if it is a :class:`RewardResult` whose total,
    parts and counts are finite numbers."""
    function = user_function(env, method)
    if not isinstance(result, RewardResult):
        raise EnvironmentOutputError(f"{function} returned {short_repr(result)} for {_item(item)}; it must return a "
                                     f"teamrl.rewards.base.RewardResult")
    if not isinstance(result.total, numbers.Real):
        raise EnvironmentOutputError(f"{function} returned a total that is not a number ({short_repr(result.total)}) "
                                     f"for {_item(item)}: {short_repr(result)}")
    if not math.isfinite(result.total):
        raise EnvironmentOutputError(f"{function} returned a non-finite total ({result.total!r}) for {_item(item)}: "
                                     f"{short_repr(result)}")
    for field in ("parts", "counts"):
        values = getattr(result, field)
        if not isinstance(values, Mapping):
            raise EnvironmentOutputError(f"{function} returned {field} that are not a dict of name -> number "
                                         f"for {_item(item)}: {short_repr(result)}")
        for name, value in values.items():
            problem = ("that is not a number" if not isinstance(value, numbers.Real)
                       else "that is not finite" if not math.isfinite(value) else None)
            if problem:
                raise EnvironmentOutputError(f"{function} returned a {field[:-1]} {name!r} {problem} "
                                             f"({short_repr(value)}) for {_item(item)}: {short_repr(result)}")
    return result


def checked_rewards(env: Environment, requests: Sequence[Request], results: Any,
                    method: str = "joint_rewards") -> list[RewardResult]:
    """``results``, which ``env.joint_rewards(requests)`` returned, if it holds one good reward per request
    (:func:`checked_reward`)."""
    _require_one_per_request(env, method, requests, results, "teamrl.rewards.base.RewardResult")
    return [checked_reward(env, item, result, method) for (item, _, _), result in zip(requests, results)]


def checked_individual_rewards(env: Environment, requests: Sequence[Request], rewards: Any,
                               method: str = "individual_rewards_many") -> list[list[float]]:
    """``rewards``, which ``env.individual_rewards_many(requests)`` returned, as lists of floats if it holds,
    per request, a sequence of ``env.num_agents`` finite numbers."""
    _require_one_per_request(env, method, requests, rewards, f"list of {env.num_agents} numbers")
    for (item, _, _), per_agent in zip(requests, rewards):
        if (isinstance(per_agent, str) or not isinstance(per_agent, Sequence) or len(per_agent) != env.num_agents
                or not all(isinstance(r, numbers.Real) and math.isfinite(r) for r in per_agent)):
            raise EnvironmentOutputError(
                f"{user_function(env, method)} returned {short_repr(per_agent)} for {_item(item)}; it must return a "
                f"list of {env.num_agents} finite numbers, one reward per agent")
    return [[float(r) for r in per_agent] for per_agent in rewards]


def _require_one_per_request(env: Environment, method: str, requests: Sequence[Request], results: Any,
                             what: str) -> None:
    """Raise unless ``results`` is a sequence of one entry per request."""
    function = user_function(env, method)
    items = short_repr(list(dict.fromkeys(_item_id(item) for item, _, _ in requests)))
    if isinstance(results, str) or not isinstance(results, Sequence):
        raise EnvironmentOutputError(f"{function} returned {short_repr(results)} for {len(requests)} joint actions "
                                     f"(items {items}); it must return a list of one {what} per joint action")
    if len(results) != len(requests):
        raise EnvironmentOutputError(
            f"{function} returned {len(results)} result(s) for {len(requests)} joint actions (items {items}); it "
            f"must return one {what} per joint action, in order: {short_repr(results)}")


def _item_id(item: Any) -> Any:
    return item.get("id") if isinstance(item, Mapping) else None


def _item(item: Item) -> str:
    """How a message names ``item``: by its id."""
    item_id = _item_id(item)
    return f"item {item_id!r}" if item_id is not None else "an item with no id"


def short_repr(value: Any) -> str:
    """``repr(value)`` on one line, cut to :data:`MAX_VALUE_CHARS`."""
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."
