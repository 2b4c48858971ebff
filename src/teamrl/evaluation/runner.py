"""``teamrl eval``: run methods (prompt-only baselines, trained teams) on one task and measure them alike.

Every method answers the same items of the same environment from the same seed and is scored by the
environment's own joint reward (:func:`teamrl.evaluation.heldout.score`). The baselines sample with the
config's ``team.sampling`` and per-agent overrides; a saved team with its own settings, those it was
trained with (``team_sampling="config"`` gives it the config's instead), and as training's held-out
evaluation samples it (:func:`teamrl.evaluation.heldout.sample_held_out`), in episodes of the config's
``algorithm.num_turns`` turns with the environment's feedback between them: ``Trainer.evaluate`` of the
same team, items and seed gives the same numbers. The prompt-only baselines answer once (one turn, no
feedback); the normalised return divides a method's mean return by the largest return of its episodes'
length, so both stand on one scale. Per method: normalised return, mean reward and the
mean of each reward part; for coding tasks pass@k, accuracy@k, the fraction of tests passed and the
cooperation-scheme distribution; for every method tokens, seconds and tokens/s of generation.

A program task (``env.name: program``) is played by its program, whoever answers its calls: ``team:PATH`` (the
trained agents), ``concat`` (the untrained team: each agent its base model) and ``single`` or ``single:MODEL`` (one
model answering every agent's calls), each behind a gateway of its own (:mod:`teamrl.serve.gateway`); a program
decides itself who sees what, so ``sequential`` and ``discussion`` do not apply.

Methods (``--methods``, comma-separated): ``single`` (the first agent's model does the whole job),
``single:MODEL`` (another model, any ``team.model`` spec), ``concat``, ``sequential``, ``discussion``
(the baselines of :mod:`teamrl.evaluation.baselines`, on the untrained team the config describes) and
``team:PATH`` (a team saved by :meth:`teamrl.team.Team.save_pretrained`, run decentralised: each agent
answers its own observation; a policy trained with ``algorithm.name: centralized``, on the single-agent prompt).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from teamrl._deprecated import moved_names
from teamrl.config import TrainConfig, config_to_dict, load_config, presets, resolve_config_path
from teamrl.envs.base import ENVIRONMENTS, Environment, Item, configured_env
from teamrl.envs.centralized import CentralizedEnv
from teamrl.envs.checks import first_observations
from teamrl.evaluation.baselines import MethodOutput
from teamrl.evaluation.heldout import sample_held_out, score
from teamrl.evaluation.methods import EvalSettings, Method, parse_methods
from teamrl.imports import ENVIRONMENT_GROUP, entry_point, is_import_path
from teamrl.inference import check_context
from teamrl.registry import BASELINES
from teamrl.rollout.generate import sample_team
from teamrl.team import Agent, Team, load_base_model

if TYPE_CHECKING:
    from teamrl.envs.program import ProgramTask


@dataclass
class MethodResult:
    """A method's metrics and every joint action it produced."""

    method: Method
    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    num_turns: int = 1
    """Turns of its episodes: a saved team's, training's ``algorithm.num_turns``; a baseline answers once."""
    max_return: float | None = None
    """The largest return of its episodes (``Environment.max_return(num_turns)``); None: one turn's
    ``max_reward``."""

    @property
    def description(self) -> str:
        """What the method does (:attr:`Method.description`) and, for episodes of several turns, how they are
        played and scored."""
        if self.num_turns == 1:
            return self.method.description
        return (f"{self.method.description} It plays episodes of {self.num_turns} turns, as training and its "
                f"held-out evaluation do (after each turn every agent answers the environment's feedback), "
                f"scored by their return: every turn's joint reward summed.")


@dataclass
class EvalResults:
    """Everything ``teamrl eval`` measured, ready for :mod:`teamrl.evaluation.report`."""

    env_name: str
    split: str
    num_items: int
    num_samples: int
    ks: tuple[int, ...]
    max_reward: float
    is_code: bool
    """Whether the task is graded by tests (:meth:`~teamrl.envs.base.Environment.test_pass_rate`: pass@k and tests
    passed apply; the coding tasks)."""
    agent_names: list[str]
    methods: list[MethodResult]
    config: dict[str, Any] = field(default_factory=dict)
    num_turns: int = 1
    """Turns of training's episodes (``algorithm.num_turns``), which saved teams play too."""
    max_return: float | None = None
    """The largest return of such an episode (``Environment.max_return``); None: ``max_reward``."""

    def method_max_return(self, result: MethodResult) -> float:
        """The largest return of ``result``'s episodes, which its normalised return divides by."""
        return result.max_return if result.max_return is not None else self.max_reward


def task_source(target: str) -> tuple[str | None, list[str]]:
    """``(config, overrides)`` for ``load_config`` from a command's task argument: a config file or preset
    (``(target, [])``), or a registered environment's name on the default config (``(None, ["env.name=..."])``).

    Raises:
        ValueError: ``target`` is neither.
    """
    if resolve_config_path(target).is_file():
        return target, []
    if target in ENVIRONMENTS or is_import_path(target) or entry_point(ENVIRONMENT_GROUP, target) is not None:
        return None, [f"env.name={target}"]
    raise ValueError(f"ENV_OR_CONFIG: {target!r} is neither an environment ({', '.join(sorted(ENVIRONMENTS))}, "
                     f"or yours as module:Class) nor a config file or preset ({', '.join(presets())})")


def eval_config(target: str, overrides: Sequence[str] = (), model: str | None = None) -> TrainConfig:
    """The config ``teamrl eval TARGET`` runs with (:func:`task_source`); ``model`` (``--model``) sets
    ``team.model`` before the overrides apply."""
    config, task = task_source(target)
    return load_config(config, [*task, *([f"team.model={model}"] if model else []), *overrides])


def run_evaluation(config: TrainConfig, settings: EvalSettings,
                   log: Callable[[str], None] = lambda message: None) -> EvalResults:
    """Run every method of ``settings`` on ``config``'s task and measure it (see the module docstring).

    Every model and saved team is loaded before anything generates, so a bad spec fails at once.
    """
    env = configured_env(config.env.name, config.env.kwargs, config.env.folders)
    try:
        items = list(env.items(settings.split))[: settings.max_items]
    except ValueError as err:
        raise ValueError(f"--split: {err}") from None
    if not items:
        raise ValueError(f"--split: {config.env.name} has no {settings.split!r} items")
    if not env.joint_prompts:
        return _run_program_evaluation(config, env, items, settings, log)
    is_code = type(env).test_pass_rate is not Environment.test_pass_rate
    if any(m.baseline == "single" for m in settings.methods) and \
            type(env).single_agent_observation is Environment.single_agent_observation:
        raise ValueError(f"--methods: single: {type(env).__name__} defines no single-agent prompt; implement "
                         f"single_agent_observation and split_single_agent_output, or leave single out")
    turns = [method_turns(method, _played_env(method, env), config.algorithm.num_turns)
             for method in settings.methods]
    teams = _load_teams(config, env, settings.methods, settings.team_sampling)
    results = []
    try:
        for method, team, num_turns in zip(settings.methods, teams, turns):
            log(f"{method.spec}: {len(items)} items x {settings.num_samples} samples ...")
            played = _played_env(method, env)
            output = _answer(method, played, team, items, settings.num_samples, config.seed, num_turns)
            metrics, samples = score(played, output, settings.num_samples, settings.ks)
            log(f"{method.spec}: normalised return {metrics['normalised_return']:.3f}, "
                f"{metrics['tokens_per_s']:.1f} tokens/s")
            results.append(MethodResult(method, metrics, samples, num_turns, env.max_return(num_turns)))
    finally:
        close = getattr(env, "close", None)  # a coding task's sandbox pool
        if close is not None:
            close()
    return EvalResults(config.env.name, settings.split, len(items), settings.num_samples, settings.ks,
                       env.max_reward, is_code, [agent.name for agent in config.team.agents], results,
                       config_to_dict(config), config.algorithm.num_turns, env.max_return(config.algorithm.num_turns))


#: The methods a program task runs when ``--methods`` is left as it is (the prompt-only pipelines are not its).
PROGRAM_METHODS = "single,concat"


def _run_program_evaluation(config: TrainConfig, task: ProgramTask, items: Sequence[Item], settings: EvalSettings,
                            log: Callable[[str], None]) -> EvalResults:
    """:func:`run_evaluation` of a program task: every method plays the program's episodes behind a gateway."""
    from teamrl.evaluation.heldout import program_held_out, program_score
    from teamrl.serve.gateway import Gateway

    names = [agent.name for agent in config.team.agents]
    task.seat(names)
    methods = settings.methods
    if methods == EvalSettings().methods:
        methods = tuple(parse_methods(PROGRAM_METHODS))
    methods = tuple(dataclasses.replace(method, program=True) for method in methods)
    refused = [method.spec for method in methods if method.baseline not in (None, "single", "concat")]
    if refused:
        raise ValueError(f"--methods: {refused[0]}: {config.env.name} is a program, which decides itself who sees "
                         f"what; use single (one model answers every agent's calls), concat (its untrained team) and "
                         f"team:PATH")
    teams = [_program_team(config, task, method, settings.team_sampling) for method in methods]
    results = []
    for method, team in zip(methods, teams):
        log(f"{method.spec}: {len(items)} items x {settings.num_samples} episodes ...")
        began = time.perf_counter()
        with Gateway(team, task) as gateway:
            episodes = program_held_out(task, gateway, items, settings.num_samples, config.seed)
        metrics, samples = program_score(task, episodes, settings.num_samples, names, time.perf_counter() - began)
        log(f"{method.spec}: normalised return {metrics['normalised_return']:.3f}, "
            f"{metrics['tokens_per_s']:.1f} tokens/s")
        results.append(MethodResult(method, metrics, samples, 1, task.max_return(1)))
    return EvalResults(config.env.name, settings.split, len(items), settings.num_samples, settings.ks,
                       task.max_reward, False, names, results, config_to_dict(config), 1, task.max_return(1))


def _program_team(config: TrainConfig, task: ProgramTask, method: Method,
                  team_sampling: Literal["saved", "config"]) -> Team:
    """Who answers the program's calls for ``method``: the saved team, the config's untrained team, or one model
    under every agent's name (``single``: the first agent's base model, ``single:MODEL`` another)."""
    names = [agent.name for agent in config.team.agents]
    if method.team_dir is not None:
        team = _load_teams(config, task, [method], team_sampling)[0]
        if [agent.name for agent in team] != names:
            raise ValueError(f"--methods: {method.spec}: the saved team's agents {[a.name for a in team]} are not "
                             f"the config's {names}")
        return team
    if method.baseline == "concat":
        return Team.from_config(config.team, task, seed=config.seed)
    spec = method.model or config.team.agents[0].model or config.team.model
    model, tokenizer = load_base_model(spec, task, seed=config.seed, dtype=getattr(torch, config.team.dtype),
                                       device=config.team.device)
    return Team([Agent(name=name, model=model, tokenizer=tokenizer, sampling=config.team.agent_sampling(0),
                       use_chat_template=config.team.use_chat_template,
                       enable_thinking=config.team.agent_enable_thinking(0), base_spec=spec) for name in names])


def method_turns(method: Method, played: Environment, num_turns: int) -> int:
    """How many turns ``method`` plays: a saved team the episodes of training and its held-out evaluation
    (``num_turns``, ``algorithm.num_turns``; one for a policy whose task is single-turn, such as a centralised
    one), a prompt-only baseline one (it answers once).

    Raises:
        ValueError: the task cannot score episodes that long (a sparse reward paid at a later turn).
    """
    if method.baseline is not None:
        played.check_num_turns(1, f"--methods {method.spec} (a prompt-only baseline answers once)")
        return 1
    turns = min(num_turns, played.max_turns or num_turns)
    played.check_num_turns(turns)
    return turns


def _load_teams(config: TrainConfig, env: Environment, methods: Sequence[Method],
                team_sampling: Literal["saved", "config"]) -> list[Team]:
    """The team each method runs: the config's untrained team (built once, shared), a one-agent team on
    another model (``single:MODEL``) or a saved team, with its own sampling settings or the config's
    (``team_sampling``)."""
    untrained: Team | None = None
    teams = []
    for method in methods:
        if method.team_dir is not None:
            team = Team.from_pretrained(method.team_dir, env, device=config.team.device, dtype=config.team.dtype)
            seats = _played_env(method, env).num_agents
            if len(team) != seats:
                raise ValueError(f"--methods: {method.spec}: the saved team has {len(team)} agents but "
                                 f"{config.env.name} has {seats} seats")
            if team_sampling == "config":
                for index, agent in enumerate(team):
                    agent.sampling = config.team.agent_sampling(index)
            if method.seats is not None:
                team = with_weights_of(team, seat_weights(team, method.seats))
        elif method.model is not None:
            model, tokenizer = load_base_model(method.model, env, seed=config.seed,
                                               dtype=getattr(torch, config.team.dtype), device=config.team.device)
            team = Team([Agent(name="single", model=model, tokenizer=tokenizer, sampling=config.team.agent_sampling(0),
                               use_chat_template=config.team.use_chat_template,
                               enable_thinking=config.team.agent_enable_thinking(0), base_spec=method.model)])
        else:
            if untrained is None:
                untrained = Team.from_config(config.team, env, seed=config.seed)
            team = untrained
        teams.append(team)
    return teams


def seat_weights(team: Team, seats: str) -> list[int]:
    """Which trained agent's weights each seat runs for :attr:`~teamrl.evaluation.methods.Method.seats`: the next
    seat's (``"swapped"``: a cycle, with two agents a swap), or one agent's (its name) in every seat."""
    names = [agent.name for agent in team]
    if seats == "swapped":
        return [(seat + 1) % len(team) for seat in range(len(team))]
    return [names.index(seats)] * len(team)


def with_weights_of(team: Team, sources: Sequence[int]) -> Team:
    """``team`` with seat i running agent ``sources[i]``'s trained weights (model, adapter, tokenizer) on seat i's
    own role and sampling settings; an agent is named WEIGHTS@SEAT."""
    return Team([dataclasses.replace(seat, name=f"{team[source].name}@{seat.name}", model=team[source].model,
                                     tokenizer=team[source].tokenizer, adapter=team[source].adapter,
                                     base_spec=team[source].base_spec, parameters=team[source].parameters,
                                     reference_model=team[source].reference_model)
                 for seat, source in zip(team, sources)])


def _played_env(method: Method, env: Environment) -> Environment:
    """The environment a method's agents play: for a saved centralised policy (``algorithm.name: centralized``
    in its ``team.json``) the task as its one agent plays it, every seat's part in one completion; else ``env``."""
    if method.team_dir is not None and \
            json.loads((method.team_dir / "team.json").read_text()).get("algorithm") == "centralized":
        return CentralizedEnv(env)
    return env


def _answer(method: Method, env: Environment, team: Team, items: Sequence[Item], num_samples: int,
            seed: int, num_turns: int = 1) -> MethodOutput:
    """The method's ``num_samples`` joint actions (episodes of ``num_turns`` turns) per item. A saved team samples
    as ``Trainer.evaluate`` does; a baseline on torch's RNG seeded with ``seed``, the same stream for every
    baseline."""
    if method.baseline is None:
        check_context(team, first_observations(env, items))
        return sample_held_out(functools.partial(sample_team, team), env, items, num_samples, seed,
                               num_turns=num_turns)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BASELINES[method.baseline](env, team, items, num_samples)


# ``teamrl eval``'s methods and settings have a module of their own, which the command line reads without torch.
__getattr__ = moved_names(__name__, {name: f"teamrl.evaluation.methods:{name}" for name in (
    "parse_methods", "parse_ks", "method_forms")})
