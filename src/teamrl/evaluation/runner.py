"""``teamrl eval``: run methods (prompt-only baselines, trained teams) on one task and measure them alike.

Every method answers the same items of the same environment from the same seed and is scored by the
environment's own joint reward (:func:`teamrl.evaluation.heldout.score`). The baselines sample with the
config's ``team.sampling`` and per-agent overrides; a saved team with its own settings, those it was
trained with (``team_sampling="config"`` gives it the config's instead), and as training's held-out
evaluation samples it (:func:`teamrl.evaluation.heldout.sample_held_out`): ``Trainer.evaluate`` of the
same team, items and seed gives the same numbers. Per method: normalised return, mean reward and the
mean of each reward part; for coding tasks pass@k, accuracy@k, the fraction of tests passed and the
cooperation-scheme distribution; for every method tokens, seconds and tokens/s of generation.

Methods (``--methods``, comma-separated): ``single`` (the first agent's model does the whole job),
``single:MODEL`` (another model, any ``team.model`` spec), ``concat``, ``sequential``, ``discussion``
(the baselines of :mod:`teamrl.evaluation.baselines`, on the untrained team the config describes) and
``team:PATH`` (a team saved by :meth:`teamrl.team.Team.save_pretrained`, run decentralised: each agent
answers its own observation; a policy trained with ``algorithm.name: centralized``, on the single-agent prompt).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from teamrl.algorithms.magrpo import team_sampler
from teamrl.config import TrainConfig, config_to_dict, load_config, presets, resolve_config_path
from teamrl.envs.base import ENVIRONMENTS, Environment, Item, make_env
from teamrl.envs.centralized import CentralizedEnv
from teamrl.envs.checks import first_observations
from teamrl.envs.coding import CodingEnv
from teamrl.evaluation.baselines import BASELINES, MethodOutput
from teamrl.evaluation.heldout import sample_held_out, score
from teamrl.imports import ENVIRONMENT_GROUP, entry_point, is_import_path
from teamrl.inference import check_context
from teamrl.team import Agent, Team, load_base_model

#: The prefix of a saved team in ``--methods``.
TEAM_PREFIX = "team"
_TITLES = {"single": "single agent", "concat": "naive concatenation (untrained team)",
           "sequential": "sequential pipeline", "discussion": "one-round discussion"}


@dataclass(frozen=True)
class Method:
    """One entry of ``--methods``: which baseline runs, and on whose model, or which saved team."""

    spec: str
    """As written, e.g. ``single:bundled`` or ``team:runs/x/team``."""
    baseline: str | None
    """The registered baseline that runs it; None for a saved team."""
    model: str | None = None
    """``single:MODEL``: the single agent's model spec."""
    team_dir: Path | None = None
    """``team:PATH``: the saved team."""

    @property
    def title(self) -> str:
        """A readable name for tables and plots."""
        if self.team_dir is not None:
            return f"trained team ({self.team_dir})"
        title = _TITLES.get(self.baseline, self.baseline)
        return f"{title} ({self.model})" if self.model else title

    @property
    def description(self) -> str:
        """What the method does and what each agent sees: the summary line of its baseline's docstring."""
        if self.team_dir is not None:
            return ("Every agent answers its own observation; the answers are the joint action. The agents are "
                    "the saved team's (trained), run decentralised and sampled as training's held-out evaluation "
                    "samples them.")
        summary = (BASELINES[self.baseline].__doc__ or "").strip().splitlines()[0]
        return f"{summary} The single agent runs on {self.model}." if self.model else summary


def parse_methods(text: str) -> list[Method]:
    """The methods of a comma-separated ``--methods`` value.

    Raises:
        ValueError: an unknown method, ``team:`` without a saved team, or a method given twice.
    """
    methods = []
    for spec in (part.strip() for part in text.split(",")):
        name, colon, argument = spec.partition(":")
        if name == TEAM_PREFIX and argument:
            directory = Path(argument).expanduser()
            if not (directory / "team.json").is_file():
                raise ValueError(f"--methods: {spec}: no saved team in {str(directory)!r} (no team.json); give a "
                                 f"directory written by Team.save_pretrained, e.g. RUN_DIR/team after teamrl train")
            methods.append(Method(spec, None, team_dir=directory))
        elif name == "single" and colon and argument:
            methods.append(Method(spec, name, model=argument))
        elif name in BASELINES and not colon:
            methods.append(Method(spec, name))
        else:
            raise ValueError(f"--methods: unknown method {spec!r}; use a comma-separated list of {method_forms()}")
    specs = [method.spec for method in methods]
    duplicates = sorted({spec for spec in specs if specs.count(spec) > 1})
    if duplicates:
        raise ValueError(f"--methods: {', '.join(duplicates)} given twice; list each method once")
    return methods


def method_forms() -> str:
    """Every form ``--methods`` accepts: the registered baselines, ``single:MODEL`` and ``team:PATH``."""
    names = [f"{name}, {name}:MODEL" if name == "single" else name for name in BASELINES]
    return ", ".join([*names, f"{TEAM_PREFIX}:PATH"])


def parse_ks(text: str) -> tuple[int, ...]:
    """The k values of a comma-separated ``--k`` value (``"1,3"``), sorted and distinct."""
    try:
        ks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--k: {text!r} is not a comma-separated list of integers, e.g. --k 1,3") from None
    if ks[0] < 1:
        raise ValueError(f"--k: every k must be >= 1 (got {text!r})")
    return tuple(ks)


@dataclass(frozen=True)
class EvalSettings:
    """What ``teamrl eval`` runs: the methods, on which items, how many samples, which k."""

    methods: tuple[Method, ...]
    split: str = "eval"
    max_items: int | None = None
    """At most this many items of the split, the first ones (None: all)."""
    num_samples: int = 1
    """n: joint actions each method samples per item (pass@k needs k <= n)."""
    ks: tuple[int, ...] = (1,)
    team_sampling: Literal["saved", "config"] = "saved"
    """How ``team:PATH`` methods sample: with each saved team's own settings (those of its training, e.g.
    its ``max_new_tokens``), or with the config's, as the baselines do."""

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError(f"--methods: no method given; use a comma-separated list of {method_forms()}")
        if self.num_samples < 1:
            raise ValueError(f"--num-samples: must be >= 1 (got {self.num_samples})")
        if self.max_items is not None and self.max_items < 1:
            raise ValueError(f"--max-items: must be >= 1 (got {self.max_items}); omit it for every item")
        too_big = [k for k in self.ks if k > self.num_samples]
        if too_big:
            raise ValueError(f"--k: k={too_big[0]} exceeds --num-samples {self.num_samples}; pass@k and "
                             f"accuracy@k need k <= n: lower --k or raise --num-samples to {max(too_big)}")


@dataclass
class MethodResult:
    """A method's metrics and every joint action it produced."""

    method: Method
    metrics: dict[str, float]
    samples: list[dict[str, Any]]


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
    """Whether the task is a coding task (pass@k, tests and cooperation schemes apply)."""
    agent_names: list[str]
    methods: list[MethodResult]
    config: dict[str, Any] = field(default_factory=dict)


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
    env = make_env(config.env.name, **config.env.kwargs)
    try:
        items = list(env.items(settings.split))[: settings.max_items]
    except ValueError as err:
        raise ValueError(f"--split: {err}") from None
    if not items:
        raise ValueError(f"--split: {config.env.name} has no {settings.split!r} items")
    is_code = isinstance(env, CodingEnv)
    if any(m.baseline == "single" for m in settings.methods) and \
            type(env).single_agent_observation is Environment.single_agent_observation:
        raise ValueError(f"--methods: single: {type(env).__name__} defines no single-agent prompt; implement "
                         f"single_agent_observation and split_single_agent_output, or leave single out")
    teams = _load_teams(config, env, settings.methods, settings.team_sampling)
    results = []
    try:
        for method, team in zip(settings.methods, teams):
            log(f"{method.spec}: {len(items)} items x {settings.num_samples} samples ...")
            played = _played_env(method, env)
            output = _answer(method, played, team, items, settings.num_samples, config.seed)
            metrics, samples = score(played, output, settings.num_samples, settings.ks)
            log(f"{method.spec}: normalised return {metrics['normalised_return']:.3f}, "
                f"{metrics['tokens_per_s']:.1f} tokens/s")
            results.append(MethodResult(method, metrics, samples))
    finally:
        close = getattr(env, "close", None)  # a coding task's sandbox pool
        if close is not None:
            close()
    return EvalResults(config.env.name, settings.split, len(items), settings.num_samples, settings.ks,
                       env.max_reward, is_code, [agent.name for agent in config.team.agents], results,
                       config_to_dict(config))


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


def _played_env(method: Method, env: Environment) -> Environment:
    """The environment a method's agents play: for a saved centralised policy (``algorithm.name: centralized``
    in its ``team.json``) the task as its one agent plays it, every seat's part in one completion; else ``env``."""
    if method.team_dir is not None and \
            json.loads((method.team_dir / "team.json").read_text()).get("algorithm") == "centralized":
        return CentralizedEnv(env)
    return env


def _answer(method: Method, env: Environment, team: Team, items: Sequence[Item], num_samples: int,
            seed: int) -> MethodOutput:
    """The method's ``num_samples`` joint actions per item. A saved team samples as ``Trainer.evaluate`` does;
    a baseline on torch's RNG seeded with ``seed``, the same stream for every baseline."""
    if method.baseline is None:
        check_context(team, first_observations(env, items))
        return sample_held_out(team_sampler(team), env, items, num_samples, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BASELINES[method.baseline](env, team, items, num_samples)
