"""Centralised MAGRPO (CoMLRL's ``CentralizedMAGRPOTrainer``): one policy writes every seat's part.

The trained baseline a decentralised team is measured against. The task becomes
:class:`~teamrl.envs.centralized.CentralizedEnv`: one agent reads the whole task o (the task's
single-agent prompt) and writes one completion a, which the task splits into the joint action
(a_1, ..., a_n) = split(a) and scores with its own joint reward r = R(split(a)). Training is MAGRPO's
with n = 1:

1. Rollout (:func:`~teamrl.rollout.tree.sample_tree`): G completions a^1..a^G of o per item, each
   scored r_g = R(split(a^g)).
2. Advantages, Eq. 1 (:func:`~teamrl.algorithms.magrpo.advantages`): A_g = r_g - mean(r) over the G
   completions (or the estimator ``algorithm.advantage`` names).
3. Update, Eq. 2: the one policy maximises mean_g A_g log pi_theta(a^g | o), every token of the
   completion (every seat's part) trained.

It runs centralised at inference too: one model, one prompt, the parts written one after another; a
team's agents answer their own prompts in parallel. Compare the two by the held-out joint reward of the
same task (``Trainer.evaluate``, ``teamrl eval team:PATH``), and by tokens and seconds per answer.
"""

from __future__ import annotations

from teamrl.algorithms.base import register_algorithm
from teamrl.algorithms.magrpo import MAGRPO
from teamrl.config import TrainConfig, require
from teamrl.envs.base import Environment
from teamrl.envs.centralized import CentralizedEnv


@register_algorithm("centralized")
class Centralized(MAGRPO):
    """MAGRPO's step (:class:`~teamrl.algorithms.magrpo.MAGRPO`) on the task as one agent plays it."""

    learns_from_programs = False  # a program calls its agents itself: there is no task to hand one agent

    @staticmethod
    def check_config(config: TrainConfig) -> None:
        """What the centralised policy cannot run with (called when a config loads)."""
        algorithm = config.algorithm
        require(algorithm.num_turns == 1, "algorithm.num_turns", "must be 1 with name='centralized' (single-turn)",
                algorithm.num_turns)
        require(algorithm.learners == "joint", "algorithm.learners",
                "must be 'joint' with name='centralized' (its one agent has no reward of its own)", algorithm.learners)
        require(len(config.team.agents) == 1, "team.agents",
                "algorithm.name='centralized' trains one policy that writes every seat's part: list exactly one "
                "agent, e.g. team.agents=[{name: central}] (docs/algorithm.md#centralized)",
                [a.name for a in config.team.agents])

    @staticmethod
    def environment(env: Environment) -> CentralizedEnv:
        """The task for one agent writing every seat's part (see :func:`~teamrl.algorithms.base.make_environment`)."""
        return CentralizedEnv(env)
