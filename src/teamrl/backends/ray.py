"""A team whose agents are Ray actors: one actor per agent, on its own CPUs, GPUs or node.

Each actor (:class:`AgentWorker`) builds its own agent from the run's config — its own copy of its
model (under Ray, LoRA agents do not share a base), its optimiser and its schedule — and keeps them for
the whole run. The :class:`~teamrl.train.Trainer` stays the driver: for every turn it sends each actor
its agent's observations and gets back a :class:`~teamrl.rollout.generate.Generation` (all actors at
once), computes rewards, returns and advantages itself exactly as in one process, then sends each
actor its completions and their advantages and gets back the update's statistics (all at once again).

What crosses the wire: observations (strings) out; completions (token ids, masks, sampling log-probs
as CPU tensors, texts) back; the same completions and their advantages out again for the update;
statistics back. Weights never move, except into a checkpoint or a saved team, which the driver writes.

Every draw is seeded from (run seed, step, turn, agent) the same way as in one process, so with the
same seed and the same team layout (``team.training: full``, or agents on different bases) a Ray run
samples the same tokens and computes the same numbers as the local one.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from teamrl.algorithms.update import make_optimizer
from teamrl.backends.local import policy_logprobs, train_agents
from teamrl.checkpoint import AgentState, agent_state, restore_agent_state
from teamrl.config import TrainConfig
from teamrl.envs.base import Environment
from teamrl.rollout.generate import Generation, derive_seed, generate
from teamrl.runtime import libraries_quiet, quiet_libraries, seed_everything
from teamrl.team import Team

PLACEMENT_TIMEOUT_S = 600.0
"""How long to wait for the cluster to reserve every agent's CPUs/GPUs before giving up with an error."""


@dataclass(frozen=True)
class Seat:
    """One seat of the environment, as :meth:`Team.from_config` reads an environment: what an actor needs
    to build that seat's agent. The environment itself (datasets, sandboxes, reward code) stays with the
    driver."""

    role: str | None
    words: list[str] | None
    """The task's vocabulary, for the 'tiny' model's tokenizer."""
    num_agents: ClassVar[int] = 1

    @property
    def roles(self) -> tuple[str, ...]:
        return () if self.role is None else (self.role,)

    def vocabulary(self) -> list[str] | None:
        return self.words


class AgentWorker:
    """One agent, its optimiser and its schedule, inside a Ray actor (``ray.remote(AgentWorker)``).

    ``quiet``: keep the libraries' output off as the driver does (:func:`teamrl.runtime.quiet_libraries`); an
    actor's process inherits neither the driver's warning filters nor, on a cluster, its environment.
    """

    def __init__(self, config: TrainConfig, index: int, seat: Seat, threads: int, quiet: bool = False):
        if quiet:
            quiet_libraries()
        torch.set_num_threads(threads)
        # The RNG as the Trainer's stands when it builds its team: whatever init draws from it (a LoRA
        # adapter's) draws what the first agent's would in one process.
        seed_everything(config.seed)
        agent_config = config.team.agents[index]
        team_config = dataclasses.replace(config.team, agents=[agent_config])
        self.agent = Team.from_config(team_config, seat, seed=config.seed,  # type: ignore[arg-type]
                                      need_reference=config.algorithm.uses_reference)[0]
        self.optimizer, self.scheduler = make_optimizer(self.agent.parameters, config, agent_config.lr)
        self.config = config

    def generate(self, observations: list[str], num_samples: int, seed: int) -> Generation:
        """``num_samples`` completions of each observation, prompted in the agent's role, on the CPU."""
        prompts = [self.agent.prompt(observation) for observation in observations]
        return _moved(generate(self.agent, prompts, num_samples, seed=seed, compile=self.config.rollout.compile),
                      "cpu")

    def logprobs(self, generation: Generation, reference: bool = False) -> torch.Tensor:
        """The log-probs of ``generation``'s completion tokens under the agent's current policy (or its
        reference), on the CPU."""
        return policy_logprobs(self.agent, _moved(generation, self.agent.parameters[0].device), reference).cpu()

    def update(self, generations: list[Generation], advantages: list[torch.Tensor], seed: int,
               loss: str = "policy_gradient") -> dict[str, float]:
        """The agent's update of a step (its completions of every turn and their advantages, the registered
        ``loss``); its stats."""
        device = self.agent.parameters[0].device
        return train_agents([self.agent], [[_moved(g, device) for g in generations]], [advantages], [self.optimizer],
                            [self.scheduler], self.config, [seed], loss)[0]

    def state(self) -> AgentState:
        """Trained parameters and optimiser and schedule state, for the driver's checkpoint."""
        return agent_state(self.agent, self.optimizer, self.scheduler)

    def load_state(self, state: AgentState, source: str) -> None:
        """Resume from ``state`` (read by the driver from checkpoint ``source``)."""
        restore_agent_state(self.agent, self.optimizer, self.scheduler, state, source)

    def saved_files(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The agent as :meth:`Team.save_pretrained` writes it: its ``team.json`` entry and its files (paths
        relative to the team directory), for the driver to write; the actor's node may not share its disk."""
        with tempfile.TemporaryDirectory() as tmp:
            root = Team([self.agent]).save_pretrained(tmp)
            entry = json.loads((root / "team.json").read_text())["agents"][0]
            files = {str(p.relative_to(root)): p.read_bytes() for p in (root / self.agent.name).rglob("*")
                     if p.is_file()}
        return entry, files


class RayTeam:
    """The team as Ray actors, one per agent, driven from this process (see the module's docstring): the
    :class:`~teamrl.algorithms.base.AgentBackend` of ``distributed.backend: ray``.

    Joins the Ray cluster at ``distributed.address`` (or uses the Ray already initialised in this process,
    or starts a local one), reserves each agent's CPUs and GPUs in one placement group (all or nothing,
    placed by ``distributed.placement``) and starts the actors.
    """

    def __init__(self, config: TrainConfig, env: Environment):
        dist = config.distributed
        if not ray.is_initialized():
            ray.init(address=dist.address)
        self.names = [agent.name for agent in config.team.agents]
        bundle = {"CPU": dist.cpus_per_agent, **({"GPU": dist.gpus_per_agent} if dist.gpus_per_agent else {})}
        self._group = placement_group([dict(bundle) for _ in self.names], strategy=dist.placement.upper())
        ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._group)
            have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            raise RuntimeError(f"distributed: Ray could not reserve {bundle} for each of {len(self.names)} "
                               f"agents (placement {dist.placement!r}) within {PLACEMENT_TIMEOUT_S:g} s; "
                               f"the cluster has {have}")
        worker = ray.remote(AgentWorker)
        threads = max(1, int(dist.cpus_per_agent))
        words = env.vocabulary()
        self._actors = [
            worker.options(
                num_cpus=dist.cpus_per_agent, num_gpus=dist.gpus_per_agent,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=i),
            ).remote(config, i, Seat(env.roles[i] if i < len(env.roles) else None, words), threads, libraries_quiet())
            for i in range(len(self.names))
        ]

    def __len__(self) -> int:
        return len(self._actors)

    @property
    def team(self) -> RayTeam:
        """The team as its user handles it (:attr:`teamrl.train.Trainer.team`): these actors."""
        return self

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        """Every agent's completions of its own observations, sampled in the actors at once."""
        # Agent i samples under the seed that generate_team gives agent i's call in one process.
        return ray.get([actor.generate.remote(list(obs), num_samples, derive_seed(seed, i))
                        for i, (actor, obs) in enumerate(zip(self._actors, observations))])

    def logprobs(self, generations: Sequence[Generation], reference: bool = False) -> list[torch.Tensor]:
        """Every agent's log-probs of its completions ``generations[i]`` (under its reference, with
        ``reference``), computed in the actors at once."""
        return ray.get([actor.logprobs.remote(gen, reference) for actor, gen in zip(self._actors, generations)])

    def update(self, generations: Sequence[list[Generation]], advantages: Sequence[list[torch.Tensor]],
               seeds: Sequence[int], loss: str = "policy_gradient") -> list[dict[str, float]]:
        """Every agent's update (agent i: its completions of every turn, their advantages, its seed; the
        registered ``loss``), at once."""
        return ray.get([actor.update.remote(agent_generations, agent_advantages, seed, loss) for actor,
                        agent_generations, agent_advantages, seed in zip(self._actors, generations, advantages, seeds)])

    def states(self) -> list[AgentState]:
        """Every agent's checkpoint state, in seat order."""
        return ray.get([actor.state.remote() for actor in self._actors])

    def load_states(self, states: Sequence[AgentState], source: str | Path) -> None:
        """Resume every agent from its state (seat order), read from checkpoint ``source``."""
        ray.get([actor.load_state.remote(state, str(source)) for actor, state in zip(self._actors, states)])

    def save(self, directory: str | Path, metadata: dict | None = None) -> Path:
        """Write the team as :meth:`Team.save_pretrained` does (loadable with :meth:`Team.from_pretrained`)."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        manifest = []
        for entry, files in ray.get([actor.saved_files.remote() for actor in self._actors]):
            for relative, data in files.items():
                (root / relative).parent.mkdir(parents=True, exist_ok=True)
                (root / relative).write_bytes(data)
            manifest.append(entry)
        (root / "team.json").write_text(json.dumps({**(metadata or {}), "agents": manifest}, indent=2))
        return root

    def shutdown(self) -> None:
        """Stop the actors and release their reservation (Ray also does both when this process exits)."""
        for actor in self._actors:
            ray.kill(actor)
        remove_placement_group(self._group)


def _moved(generation: Generation, device: torch.device | str) -> Generation:
    """``generation`` with its tensors on ``device``."""
    return dataclasses.replace(generation, **{
        f.name: getattr(generation, f.name).to(device) for f in dataclasses.fields(generation)
        if isinstance(getattr(generation, f.name), torch.Tensor)
    })
