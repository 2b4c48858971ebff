"""The Dec-POMDP interface every task implements.

An environment turns a dataset item into each agent's first observation, scores a joint action (one
completion per agent) with one joint reward, and, in multi-turn episodes, turns the history of an
episode into each agent's next observation. Agents only ever see their own observation: there is no
controller at inference time.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from teamrl.registry import Registry
from teamrl.rewards.base import RewardResult
from teamrl.user_code import user_method

Item = dict[str, Any]


@dataclass(frozen=True)
class Step:
    """One turn of an episode: what each agent saw, what it did, and the joint reward it got."""

    observations: tuple[str, ...]
    actions: tuple[str, ...]
    reward: RewardResult


class Environment(ABC):
    """A cooperative task for ``num_agents`` agents.

    Subclasses set ``num_agents``, ``roles`` (a default system prompt per seat) and ``splits`` (the
    items of 'train' and 'eval') and implement :meth:`observe` and :meth:`joint_reward`; multi-turn tasks also implement
    :meth:`next_observations`. Rewards are plain functions of the joint action; override
    :meth:`joint_rewards` only to score a batch more efficiently (e.g. in a sandbox pool). For the
    prompt-only baselines (``teamrl eval``), a task implements :meth:`single_agent_observation` and
    :meth:`split_single_agent_output` (one model doing the whole job) and may name its seats' outputs
    (:attr:`output_names`) or override :meth:`teammates_observation` (agents shown each other's answers).
    """

    num_agents: int = 2
    roles: Sequence[str] = ()
    max_turns: int | None = 1
    """Longest episode the task supports (None = any)."""
    max_reward: float = 1.0
    """Largest joint reward of one turn; normalised returns divide by the episode's largest return, built on it
    (:meth:`max_return`)."""
    turn_reward: Literal["state", "increment"] = "state"
    """What one turn's joint reward measures. 'state': how good what the team holds after the turn is (a
    program, a text), which a team that stays there earns again on every later turn. 'increment': what the
    turn added (shaped progress, whose turns add up to the final score), so a team that stays earns nothing
    more. It decides what a joint action that early termination stopped is worth
    (docs/algorithm.md#early-termination-an-absorbing-state) and an episode's largest return."""

    joint_prompts: bool = True
    """Whether teamrl builds each agent's prompt of an item (:meth:`observe`); False for a program task, whose own
    code builds every prompt and calls the agents one by one (:class:`~teamrl.envs.program.ProgramTask`)."""

    splits: dict[str, Sequence[Item]]
    """The dataset: items per split ('train' and the held-out 'eval'); set by the constructor. An item
    without an ``id`` gets ``"SPLIT-INDEX"`` (reports, samples and pairings name items by id)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A user's task class (one defined outside teamrl) has the methods it defines of :data:`USER_METHODS`
        marked as user code: an exception they raise stops teamrl with one line naming the method, the item
        and the line of the user's file (:mod:`teamrl.user_code`), wherever teamrl calls them."""
        super().__init_subclass__(**kwargs)
        if cls.__module__.partition(".")[0] == "teamrl":
            return
        for name in USER_METHODS:
            method = cls.__dict__.get(name)
            if inspect.isfunction(method):
                setattr(cls, name, user_method(cls.__qualname__, method))

    def __new__(cls, *args: Any, **kwargs: Any) -> Environment:
        env = super().__new__(cls)
        # What the environment was built from, so that a saved team records how to build it again
        # (env_record), whether a config or the user's own code constructed it.
        env._constructor_arguments = (args, kwargs)
        return env

    def items(self, split: str = "train") -> Sequence[Item]:
        """The dataset items of ``split`` ('train' or 'eval'), each with an ``id``."""
        if split not in self.splits:
            raise ValueError(f"split must be {' or '.join(map(repr, self.splits))} (got {split!r})")
        items = self.splits[split]
        if any(not isinstance(item, dict) or item.get("id") is None for item in items):
            items = self.splits[split] = [_with_id(item, f"{split}-{index}", type(self).__name__, split)
                                          for index, item in enumerate(items)]
        return items

    @abstractmethod
    def observe(self, item: Item) -> list[str]:
        """Each agent's first observation of ``item``, in seat order."""

    @abstractmethod
    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        """The one reward all agents share for the joint action ``actions`` taken after ``history``."""

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        """Each agent's observation after ``history`` (multi-turn tasks override this)."""
        raise NotImplementedError(f"{type(self).__name__} is single-turn: it has no next observations")

    def max_return(self, num_turns: int) -> float:
        """The largest undiscounted return of an episode of ``num_turns`` turns: ``max_reward`` on every turn
        ('state' rewards) or once ('increment' rewards: the turns add up to one final score)."""
        return self.max_reward * (num_turns if self.turn_reward == "state" else 1)

    def check_num_turns(self, num_turns: int, field: str = "algorithm.num_turns") -> None:
        """Refuse, with a one-line ValueError that names ``field`` (where the episode length was set), episodes
        of ``num_turns`` turns that this task cannot score: by default longer than :attr:`max_turns`; a task
        whose reward is paid at a fixed turn (a sparse reward) also refuses shorter ones."""
        if self.max_turns is not None and num_turns > self.max_turns:
            raise ValueError(f"{field}: {type(self).__name__} supports at most {self.max_turns} turns "
                             f"(got {num_turns})")

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        """A reward per agent, for the independent-learner baseline (``algorithm.learners='individual'``):
        agent i's reward depends on its own completion ``actions[i]`` (and the item) alone."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no individual rewards; use algorithm.learners='joint'"
        )

    def individual_rewards_many(
        self, requests: Sequence[tuple[Item, Sequence[str], Sequence[Step]]]
    ) -> list[list[float]]:
        """:meth:`individual_rewards` of many joint actions; the default scores them one by one. The
        rollout calls it right after :meth:`joint_rewards` on the same requests, so a task can reuse
        that grading (e.g. a sandbox run) instead of repeating it."""
        return [self.individual_rewards(item, actions, history) for item, actions, history in requests]

    def joint_rewards(
        self, requests: Sequence[tuple[Item, Sequence[str], Sequence[Step]]]
    ) -> list[RewardResult]:
        """Score many joint actions; the default scores them one by one."""
        return [self.joint_reward(item, actions, history) for item, actions, history in requests]

    def function_behind(self, method: str) -> str | None:
        """The name of a user's function that ``method`` calls to do its work (the reward function behind
        ``joint_reward``), for errors about what it returned; None: the method is the task's own code."""
        return None

    def user_code(self) -> Sequence[Any]:
        """Functions of users' modules the task calls besides its class's own (a saved team records the
        folders they import from)."""
        return ()

    def vocabulary(self) -> list[str] | None:
        """Words a word-level tokenizer needs for this task (the 'tiny' test model's vocabulary).

        By default the words of the roles and of every item's first observations (the first
        :data:`VOCABULARY_ITEMS` items of each split); a task whose agents must write words its prompts
        never show (digits, names) lists them itself.
        """
        texts = [*self.roles]
        for split in self.splits:
            for item in list(self.items(split))[:VOCABULARY_ITEMS]:
                texts += self.observe(item)
        return sorted({word for text in texts for word in text.split()}) or None

    # --------------------------------------------------------------------------------------------
    # Hooks of the prompt-only baselines (teamrl.evaluation.baselines). Training and decentralised
    # execution never call them: they only let a baseline put the same task to other set-ups.

    output_names: Sequence[str] = ()
    """What each seat writes ("one-sentence summary", "helper function `aux`"): labels a teammate's
    answer in :meth:`teammates_observation`. Empty: "answer"."""
    single_agent_role: str | None = None
    """System prompt of the single-agent baseline, the one model that does every seat's part."""

    def single_agent_observation(self, item: Item) -> str:
        """The single-agent baseline's one prompt: the whole task, asking for every seat's part in one
        answer, in the layout :meth:`split_single_agent_output` reads back."""
        raise NotImplementedError(f"{type(self).__name__} defines no single-agent prompt (single_agent_observation)")

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """The joint action (one part per seat) a single model's ``completion`` stands for, so that
        :meth:`joint_reward` scores the single agent exactly as it scores a team."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot split a single agent's answer (split_single_agent_output)")

    def teammates_observation(self, item: Item, seat: int, observation: str,
                              teammates: Sequence[tuple[int, str]], own: str | None = None) -> str:
        """Agent ``seat``'s observation when a prompt-only team shows answers around (the sequential
        pipeline and the one-round discussion): its own ``observation``, its own earlier answer
        (``own``, when it is asked to revise), each teammate's answer (``(seat, text)`` pairs), and a
        request to write, or revise, its part so that it fits theirs.
        """
        parts = [observation]
        if own is not None:
            parts.append(f"Your first answer:\n{own}")
        parts += [f"Your teammate's {self._output_name(other)}:\n{text}" for other, text in teammates]
        whose = "your teammate's" if len(teammates) == 1 else "your teammates'"
        request = "Revise your answer" if own is not None else "Write your answer"
        parts.append(f"{request} so that it fits with {whose}. Reply with your own part only.")
        return "\n\n".join(parts)

    #: The cooperation schemes :meth:`cooperation_scheme` tells apart, in the order evaluations report them
    #: (the coding task: the paper's fallback, decorator, coordinator, strategy filter and the rest); none here.
    cooperation_schemes: tuple[str, ...] = ()

    def cooperation_scheme(self, item: Item, actions: Sequence[str]) -> str | None:
        """The scheme of :attr:`cooperation_schemes` the joint action ``actions`` shows, for the evaluation's
        distribution of them; None for a task that names none (the default)."""
        return None

    def test_pass_rate(self, item: Item, reward: RewardResult) -> float | None:
        """The fraction of ``item``'s tests a joint action passed, read from its joint ``reward``, for a task graded
        by tests (evaluations then report pass@k, accuracy@k and tests passed); None for one that is not (the
        default)."""
        return None

    def _output_name(self, seat: int) -> str:
        return self.output_names[seat] if seat < len(self.output_names) else "answer"


def sparse_too_short(field: str, num_turns: int, pay_turn: int, turns_field: str) -> str:
    """The error for episodes that end before a sparse reward's one paying turn: they would earn 0 everywhere."""
    return (f"{field}: sparse: true pays only at turn env.kwargs.{turns_field} = {pay_turn}, so a {num_turns}-turn "
            f"episode earns 0 everywhere; play {pay_turn} turns (algorithm.num_turns: {pay_turn}, or lower "
            f"env.kwargs.{turns_field}) or use the shaped reward (env.kwargs.sparse: false), whose turns add up to "
            f"the same return")

USER_METHODS = ("observe", "next_observations", "joint_reward", "joint_rewards", "individual_rewards",
                "individual_rewards_many", "single_agent_observation", "split_single_agent_output",
                "teammates_observation", "cooperation_scheme", "test_pass_rate")
"""The methods teamrl calls on a task with an item (or a batch of them) and whose exceptions it reports as the
user's (:meth:`Environment.__init_subclass__`)."""

VOCABULARY_ITEMS = 1000
"""Items per split whose observations the default :meth:`Environment.vocabulary` reads."""


def _with_id(item: Any, default_id: str, env_name: str, split: str) -> Item:
    if not isinstance(item, dict):
        raise ValueError(f"{env_name}.splits[{split!r}]: items must be dicts of fields (got {item!r:.80})")
    return item if item.get("id") is not None else {**item, "id": default_id}


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment", "env.name")
register_env = ENVIRONMENTS.register
"""``@register_env(name)``: class decorator making an environment constructible by name from a config."""


def environment_factory(name: str) -> Callable[..., Environment]:
    """What ``env.name`` names: a registered environment, one an installed package publishes (entry-point
    group ``teamrl.environments``), or an import path ``module:Class`` (``teamrl.imports``)."""
    from teamrl import envs  # noqa: F401  (registers the built-in environments)
    from teamrl.imports import ENVIRONMENT_GROUP, entry_point, entry_point_names, is_import_path, load_object

    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    factory = load_object(name, "env.name") if is_import_path(name) else entry_point(ENVIRONMENT_GROUP, name)
    if factory is None:
        known = ", ".join(sorted({*ENVIRONMENTS, *entry_point_names(ENVIRONMENT_GROUP)}))
        raise ValueError(f"env.name: unknown environment {name!r}; registered: {known}; or give your own class "
                         f"as module:Class (e.g. my_tasks:FactQA, my_tasks.py in the config's folder or the "
                         f"working directory)")
    if not callable(factory):
        raise ValueError(f"env.name: {name!r} is a {type(factory).__name__}, not an Environment class")
    return factory


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build the environment ``name`` (:func:`environment_factory`) with ``kwargs``; errors name the bad field."""
    factory = environment_factory(name)
    try:
        env = factory(**kwargs)
    except TypeError as err:
        raise ValueError(f"env.kwargs: {name!r} does not accept these arguments ({err})") from None
    if not isinstance(env, Environment):
        raise ValueError(f"env.name: {name!r} built a {type(env).__name__}, not a teamrl.Environment subclass")
    return env


def env_record(env: Environment) -> dict[str, Any]:
    """How to build ``env`` again in another process, for a saved team's ``team.json``: ``name`` (a
    registered name or ``module:Class``), the ``kwargs`` it was constructed with and the ``folders`` its
    module imports from. Raises ValueError when that cannot be written down (a class defined in
    ``__main__`` or in a function, or arguments that are not plain data)."""
    from teamrl.imports import import_path_of, module_folder

    cls = type(env)
    # A user's class by module:Class even when it registered a name (@register_env): a new process knows the
    # name only once that module is imported, which the import path does.
    registered = next((key for key, factory in ENVIRONMENTS.items() if factory is cls), None)
    name = registered if cls.__module__.partition(".")[0] == "teamrl" else import_path_of(cls)
    if name is None:
        raise ValueError(f"{cls.__qualname__} is defined in {cls.__module__!r}, where another process cannot "
                         f"import it: define it in a module file (e.g. my_tasks.py) and import it from there")
    args, kwargs = getattr(env, "_constructor_arguments", ((), {}))
    try:
        bound = inspect.signature(cls).bind(*args, **kwargs)
    except TypeError:
        bound = None
    arguments = dict(bound.arguments) if bound is not None else dict(kwargs)
    for parameter in inspect.signature(cls).parameters.values() if bound is not None else ():
        if parameter.kind is parameter.VAR_KEYWORD and parameter.name in arguments:
            arguments.update(arguments.pop(parameter.name))
    try:
        json.dumps(arguments)
    except TypeError as err:
        raise ValueError(f"{cls.__qualname__} was built with arguments that are not plain data ({err}), so a "
                         f"saved team cannot record them; pass names, numbers, strings, lists and dicts") from None
    folders = sorted({folder for folder in map(module_folder, (cls, *env.user_code())) if folder})
    return {"name": name, "kwargs": arguments, **({"folders": folders} if folders else {})}


def saved_team_task(team_dir: str | Path) -> tuple[dict[str, Any], Environment]:
    """A saved team's manifest (``team.json``) and the task it records, built again (:func:`rebuild_env`);
    one-line errors for a folder that is not a saved team or a team that records no task."""
    manifest_file = Path(team_dir) / "team.json"
    if not manifest_file.is_file():
        raise ValueError(f"TEAM: {str(team_dir)!r} is not a saved team (no team.json); give the directory training "
                         f"wrote, RUN_DIR/team")
    manifest = json.loads(manifest_file.read_text())
    if "env" not in manifest:
        raise ValueError(f"{team_dir}: team.json records no task to turn inputs into the agents' observations")
    return manifest, rebuild_env(manifest["env"])


def rebuild_env(record: dict[str, Any]) -> Environment:
    """The environment a :func:`env_record` describes (as a saved team's ``team.json`` holds it)."""
    if "unavailable" in record:
        raise ValueError(f"team.json: this team's task, {record['name']}, cannot be built again: "
                         f"{record['unavailable']}; in Python, pass it: Team.from_pretrained(path, env=...)")
    return configured_env(record["name"], record.get("kwargs", {}), record.get("folders", ()))


def configured_env(name: str, kwargs: dict[str, Any], folders: Sequence[str] = ()) -> Environment:
    """:func:`make_env` of a config's ``env`` section: ``folders`` (where the user's modules are) searched first."""
    from teamrl.imports import add_search_folder

    for folder in folders:
        add_search_folder(folder)
    return make_env(name, **kwargs)
