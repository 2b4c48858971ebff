"""Training algorithms, selectable by ``algorithm.name``: what a step learns from its rollout.

Every algorithm shares the step's first half, :func:`teamrl.rollout.tree.sample_tree` (each agent's G
completions of its observations, joint actions, rewards, the multi-turn tree). What it does with the tree
is its own: MAGRPO (:mod:`teamrl.algorithms.magrpo`) computes group-relative advantages and updates every
agent through its :class:`AgentBackend` (where the agents live: :mod:`teamrl.backends`, which implement this
protocol; nothing here imports them); another algorithm may derive advantages from a
learned critic, pair joint actions into preferences, or train a reward model first. An algorithm is a
class registered under its name with :func:`register_algorithm`, built once per run by
:func:`make_algorithm`; what it trains besides the agents (a critic, a reward model) it hands to the
Trainer's checkpoints through :meth:`Algorithm.states`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from teamrl.config import TrainConfig
from teamrl.registry import ALGORITHMS

if TYPE_CHECKING:
    import torch

    from teamrl.checkpoint import AgentState
    from teamrl.envs.base import Environment
    from teamrl.rollout.generate import Generation
    from teamrl.rollout.tree import RolloutTree


class AgentBackend(Protocol):
    """A team's agents, in seat order, wherever they live."""

    names: list[str]
    """Every agent's name, in seat order."""

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        """For every agent i, ``num_samples`` completions of each of its own observations ``observations[i]``,
        prompted in its role; ``seed`` fixes the tokens (the same ones in every implementation)."""
        ...

    def logprobs(self, generations: Sequence[Generation], reference: bool = False) -> list[torch.Tensor]:
        """For every agent i, the (B, C) log-probs of ``generations[i]``'s completion tokens under its
        current policy (temperature-scaled, as sampled), or with ``reference`` under its frozen reference
        policy, without gradients."""
        ...

    def update(self, generations: Sequence[list[Generation]], advantages: Sequence[list[torch.Tensor]],
               seeds: Sequence[int], loss: str = "policy_gradient") -> list[dict[str, float]]:
        """Every agent's update of a step (agent i: its completions of every turn, their advantages, the
        seed of whatever its update draws); each agent's statistics and the learning rate it leaves.
        ``loss``: the registered loss (:data:`~teamrl.algorithms.losses.LOSSES`) it minimises, whose per-row
        values ``advantages`` holds."""
        ...

    def states(self) -> list[AgentState]:
        """Every agent's trained parameters and optimiser and schedule state, for a checkpoint."""
        ...

    def load_states(self, states: Sequence[AgentState], source: str | Path) -> None:
        """Resume every agent from its state, read from checkpoint ``source``."""
        ...

    def save(self, directory: str | Path, metadata: dict | None = None) -> Path:
        """Write the team as :meth:`Team.save_pretrained` does (loadable with :meth:`Team.from_pretrained`)."""
        ...


class Algorithm(Protocol):
    """One run's learning rule. Built as ``cls(config, env, agents)``."""

    def learn(self, tree: RolloutTree, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        """Learn from one step's rollout ``tree``: update every agent of ``agents`` (``seeds[i]`` seeds whatever
        agent i's update draws) and whatever else the algorithm trains; the step's metrics."""
        ...

    def states(self) -> dict[str, AgentState]:
        """What the algorithm trains besides the agents (a critic, a reward model), by a name no agent has,
        for checkpoints; empty when it trains nothing else."""
        ...

    def load_states(self, states: dict[str, AgentState], source: str | Path) -> None:
        """Resume from :meth:`states`' entries, read from checkpoint ``source``."""
        ...

    #: The ``algorithm.*`` settings this algorithm does not read (other algorithms' sections, an estimator it has no
    #: use for): a config that sets one to anything but its default is refused at load, naming it, rather than
    #: silently running without it. Optional; empty when absent.
    ignores: tuple[str, ...]


class TrainsTheAgentsOnly:
    """:meth:`Algorithm.states` and :meth:`Algorithm.load_states` of an algorithm that trains the agents and
    nothing else: it adds nothing to the checkpoints (and ``distributed.backend: fsdp``, which shards the agents,
    can run it)."""

    trains_only_the_agents = True

    def states(self) -> dict[str, AgentState]:
        return {}

    def load_states(self, states: dict[str, AgentState], source: str | Path) -> None:
        pass


register_algorithm = ALGORITHMS.register
"""``@register_algorithm(name, advantage=None, uses_reference=False)``: make an :class:`Algorithm` class selectable
as ``algorithm.name: name``. ``advantage``: the advantage estimator the name fixes (MARLOO is MAGRPO with 'rloo';
``algorithm.advantage`` may then only be empty or the same); ``uses_reference``: its update reads each agent's frozen
reference policy whatever ``algorithm.kl_coef`` says (MADPO's log-ratios). A class may also have a static
``check_config(config: TrainConfig)`` raising :class:`~teamrl.config.ConfigError` for settings it cannot run with,
which loading a config calls, and a static ``environment(env)`` (:func:`make_environment`)."""


def algorithm_class(name: str) -> type:
    """The class registered as ``name`` (or imported from the ``module:Class`` path ``name``).

    Raises:
        teamrl.registry.RegistryError: nothing is registered as ``name``; the message lists what is.
    """
    return ALGORITHMS.lookup(name)


def make_environment(config: TrainConfig, env: Environment) -> Environment:
    """The environment the run's agents play: the task ``env`` itself, or what the algorithm makes of it
    when its class has a static ``environment(env)`` (``centralized``: one agent writing every seat's part)."""
    wrap = getattr(algorithm_class(config.algorithm.name), "environment", None)
    return env if wrap is None else wrap(env)


def make_algorithm(config: TrainConfig, env: Environment, agents: AgentBackend) -> Algorithm:
    """The algorithm ``config.algorithm.name`` names, for this run's environment and agents."""
    return algorithm_class(config.algorithm.name)(config, env, agents)
