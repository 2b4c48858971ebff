"""A team's task as one agent plays it: the centralised baseline's environment (``algorithm.name: centralized``).

:class:`CentralizedEnv` wraps a task with the prompt-only single-agent baseline's two hooks: its one seat
reads the whole task (:meth:`~teamrl.envs.base.Environment.single_agent_observation`, under the task's
``single_agent_role``), and its completion is split into every seat's part
(:meth:`~teamrl.envs.base.Environment.split_single_agent_output`), which the task's own joint reward
scores. So one policy trained on it learns from the very reward a decentralised team learns from, on the
same items, and its held-out joint reward is comparable to a team's
(:func:`~teamrl.evaluation.baselines.as_inner_joint_actions`).
"""

from __future__ import annotations

from collections.abc import Sequence

from teamrl.envs.base import Environment, Item, Step
from teamrl.rewards.base import RewardResult


class CentralizedEnv(Environment):
    """``inner``'s task for one agent that writes every seat's part in one completion; single-turn.

    Raises:
        ValueError: ``inner`` defines no single-agent prompt.
    """

    num_agents = 1
    max_turns = 1

    def __init__(self, inner: Environment):
        if type(inner).single_agent_observation is Environment.single_agent_observation:
            raise ValueError(f"algorithm.name: 'centralized' needs a task a single agent can play; "
                             f"{type(inner).__name__} defines no single_agent_observation and "
                             f"split_single_agent_output")
        self.inner = inner
        self.roles = (inner.single_agent_role,) if inner.single_agent_role else ()
        self.max_reward, self.turn_reward = inner.max_reward, inner.turn_reward
        self.splits = inner.splits

    def observe(self, item: Item) -> list[str]:
        return [self.inner.single_agent_observation(item)]

    def inner_actions(self, item: Item, actions: Sequence[str]) -> list[str]:
        """The inner task's joint action that the one agent's completion ``actions[0]`` stands for."""
        return self.inner.split_single_agent_output(item, actions[0])

    def check_num_turns(self, num_turns: int, field: str = "algorithm.num_turns") -> None:
        super().check_num_turns(num_turns, field)
        self.inner.check_num_turns(num_turns, field)  # e.g. a sparse task that pays at a later turn

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        return self.inner.joint_reward(item, self.inner_actions(item, actions), history)

    def joint_rewards(self, requests: Sequence[tuple[Item, Sequence[str], Sequence[Step]]]) -> list[RewardResult]:
        # Through the inner task's batch scoring (a coding task's sandbox pool).
        return self.inner.joint_rewards([(item, self.inner_actions(item, actions), history)
                                         for item, actions, history in requests])

    def vocabulary(self) -> list[str] | None:
        return self.inner.vocabulary()
